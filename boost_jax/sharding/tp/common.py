"""What the three tensor-parallel layouts (megatron, vanilla, btp) share: the context, the TP
collectives, the ops they inherit (TPOps: fetch, the vocab-parallel embedding and head, LaX's
first latents) and the head's collective list the planner prices (TPColl, head_collectives).

Everything here runs inside the training step's shard_map, manual over every mesh axis, with
check_vma=True: JAX types each value as invariant (identical on all TP ranks) or varying,
inserts `pcast(..., to="varying")` where an invariant value meets a varying one, and transposes
psum ↔ pcast, so backward collectives sit exactly where the Megatron f/g operators put them.
We place some pcasts explicitly so that one backward all-reduce covers a whole group of
projections instead of one per matmul. (The one exception, Pallas kernels in the interpreter,
is boost_jax.backends.cpu.untyped_tp_grads.) Each layout's own collectives per block are
listed beside its code (block_collectives in megatron.py, vanilla.py, btp.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# the layouts' matmul is the model's
from boost_jax.layers.forward import (LATENT_NAME, REDUCED_NAME, apply_norm, first_latents,
                                      latent_keys, logits_matmul, matmul)
from boost_jax.backends.cpu import check_vma
from boost_jax.mesh import axis_size
from boost_jax.pallas import dispatch
from boost_jax.sharding.gather import to_varying as _to_varying


@dataclass(frozen=True)
class TPContext:
    mode: str  # megatron | vanilla | btp
    arch: str  # model.arch: full | svd | cola | lax
    axes: tuple[str, ...]  # TP mesh axes
    t: int  # TP degree
    d: int
    r: int
    eps: float
    dtype: jnp.dtype  # compute dtype
    tie: bool
    kernels: str  # resolved implementation of the fused kernels: xla | pallas
    check_vma: bool = True  # shard_map flag (False only for interpreted kernels: backends/cpu.py)
    latent_keys: tuple = ()  # LaX: the latents a block passes on (layers/forward.latent_keys)

    @property
    def lax(self) -> bool:
        return self.arch == "lax"


def make_context(cfg, mesh) -> TPContext:
    m, par = cfg.model, cfg.parallel
    axes = tuple(par.tp_axes)
    return TPContext(
        mode=par.tp_mode, arch=m.arch, axes=axes, t=axis_size(mesh, axes),
        d=m.d_model, r=m.r, eps=m.norm_eps, dtype=jnp.dtype(m.dtype), tie=m.tie_embeddings,
        kernels=dispatch.resolve(par.kernels), check_vma=check_vma(cfg),
        latent_keys=latent_keys(m))


@dataclass
class TPColl:
    """One TP collective of a block or the head as the planner prices it (plan/roofline.py)."""

    name: str
    kind: str
    payload: float  # bytes per device, one micro-batch


# --------------------------------------------------------------------------- collectives


def psum(ctx: TPContext, x):
    """All-reduce over the TP axes (a pytree: XLA's all-reduce combiner merges the ops)."""
    return jax.lax.psum(x, ctx.axes)


def to_varying(ctx: TPContext, x):
    """Megatron's f: identity forward, all-reduce of the cotangent backward."""
    return _to_varying(x, ctx.axes)


def rank_index(ctx: TPContext):
    """Linear index of this rank over the TP axes, major-to-minor as in P((ax0, ax1, ...))."""
    return jax.lax.axis_index(ctx.axes)


def all_gather(ctx: TPContext, x, axis: int):
    """Tiled all-gather over the TP axes with a replicated (invariant) result: its transpose
    is this rank's slice of the cotangent, with no communication. (Untyped, the plain
    all-gather, whose transpose is the reduce-scatter an untyped cotangent needs.)"""
    to = "invarying" if ctx.check_vma else "varying"
    return jax.lax.all_gather(x, ctx.axes, axis=axis % x.ndim, tiled=True, to=to)


def local_slice(ctx: TPContext, x, axis: int):
    """This rank's 1/t slice of a replicated x (backward: all-reduce through the pcast)."""
    n = x.shape[axis] // ctx.t
    return jax.lax.dynamic_slice_in_dim(to_varying(ctx, x), rank_index(ctx) * n, n, axis)


def name_latent(x):
    return checkpoint_name(x, LATENT_NAME)


def name_reduced(x):
    return checkpoint_name(x, REDUCED_NAME)


# --------------------------------------------------------------------------- embedding, head


def embed_d_sharded(ctx: TPContext) -> bool:
    """btp's untied table is split along d; megatron, vanilla and any tied table along V."""
    return ctx.mode == "btp" and not ctx.tie


def embed(ctx: TPContext, table, tokens):
    """tokens [b, s] (replicated over TP) → h: btp [b, s, d/t], otherwise [b, s, d].

    Split along d, rank i looks up its own slice h_i, no collective. Split along V
    (vocab-parallel), each rank looks up the tokens it owns (zeros elsewhere), then one
    all-reduce [b,s,d] (btp then keeps its d-slice). Backward needs no TP collective."""
    if embed_d_sharded(ctx):
        return jnp.take(table, tokens, axis=0).astype(ctx.dtype)
    vt = table.shape[0]
    local = tokens - rank_index(ctx) * vt
    own = (local >= 0) & (local < vt)
    e = jnp.take(table, jnp.clip(local, 0, vt - 1), axis=0)
    e = psum(ctx, jnp.where(own[..., None], e, 0).astype(ctx.dtype))  # one rank owns each row
    return local_slice(ctx, e, axis=e.ndim - 1) if ctx.mode == "btp" else e


def vocab_parallel_cross_entropy(ctx: TPContext, x, w, targets):
    """Mean CE of logits x·w where w [d, V/t] is this rank's vocab slice; x [b, s, d].

    The logits stay [b, s, V/t] per rank (fp32), never replicated [b, s, V]:
        m = pmax(max_v logits_i)       (stop-gradient; one all-reduce of b·s)
        S = Σ_ranks Σ_v exp(logits_i − m), gold = Σ_ranks logits_i[target] (one of 2·b·s)
        loss = mean(log S + m − gold)"""
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
    """Final norm + LM head w [d, V/t] (or the tied table transposed) → mean cross-entropy.

    BTP all-gathers h once (b·s·d) and applies the replicated final norm. Backward: the head
    input's cotangent is all-reduced over ranks (b·s·d, the pcast of the normed h entering the
    per-rank GEMM; btp: the reduce-scatter of h's cotangent, the transpose of its gather)."""
    if ctx.mode == "btp":
        # typed varying: each rank's head computes only its vocab slice, so the backward of
        # this gather is the reduce-scatter of the ranks' partial cotangents
        h = jax.lax.all_gather(h, ctx.axes, axis=h.ndim - 1, tiled=True)
    x = apply_norm(h, norm, ctx.eps, ctx.dtype)
    return vocab_parallel_cross_entropy(ctx, x, w, targets)


def head_collectives(mode: str, T: int, d: int, e: int) -> tuple[list[TPColl], list[TPColl]]:
    """(forward, backward) TP collectives of embed + head_loss per micro-batch of T tokens at
    e bytes an element: btp gathers h (b·s·d) and reduce-scatters its cotangent; the others
    all-reduce the embedding and the head input's cotangent (b·s·d); all reduce the CE's max
    (b·s) and its sum-exp and gold (2·b·s) in fp32. (The planner charges no embedding
    all-reduce for btp, tied or not.)"""
    if mode == "btp":
        fwd = [TPColl("gather_h", "all-gather", e * T * d)]
        bwd = [TPColl("scatter_dh", "reduce-scatter", e * T * d)]
    else:
        fwd = [TPColl("embed", "all-reduce", e * T * d)]
        bwd = [TPColl("head_dh", "all-reduce", e * T * d)]
    fwd += [TPColl("ce_max", "all-reduce", 4 * T), TPColl("ce_sum", "all-reduce", 8 * T)]
    return fwd, bwd


# --------------------------------------------------------------------------- the shared ops


class TPOps:
    """The part of forward.Ops every TP layout inherits; each layout's subclass adds
    project_in / project_out."""

    def __init__(self, ctx: TPContext, fetch: Optional[Callable] = None):
        self.ctx = ctx
        self._fetch = fetch

    def fetch(self, weights, path):
        return weights if self._fetch is None else self._fetch(weights, path)

    def init_prev(self, tokens):
        """LaX: the first block crosses with zeros (replicated, like every TP latent)."""
        if not self.ctx.lax:
            return None
        return first_latents(tokens, self.ctx.r, self.ctx.dtype, self.ctx.latent_keys)

    def embed(self, table, tokens):
        return embed(self.ctx, table, tokens)

    def head_loss(self, h, norm, w, targets):
        return head_loss(self.ctx, h, norm, w, targets)
