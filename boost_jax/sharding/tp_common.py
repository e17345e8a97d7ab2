"""Pieces shared by the three tensor-parallel decoders (megatron, vanilla, btp).

Everything here runs *inside* `jax.shard_map` over the TP axes only (the data-parallel axes stay
automatic; `tp_shard_map` builds it), with `check_vma=True`: JAX types every value as invariant
(identical on all TP ranks) or varying, inserts `pcast(..., to="varying")` where an invariant
value meets a varying one, and transposes psum ↔ pcast, so backward collectives sit exactly
where the Megatron f/g operators put them. We place some `pcast`s explicitly so that one
backward all-reduce covers a whole group of projections instead of one per matmul.

One exception, ctx.check_vma=False: BTP with parallel.kernels=pallas where the kernels run in
the Pallas interpreter (no GPU) — the interpreter's loops can't carry varying types. JAX then
uses its untyped rules: pcast is the identity, psum transposes to psum, the shard_map's
transpose divides a TP-replicated output's cotangent by the TP degree and psums the cotangent
of every TP-replicated input. That differentiates the mean over ranks of the per-rank outputs,
which is the loss itself (it is identical on every rank), so the gradient is the same, only
with more backward all-reduces — fine for a CPU test path (tests/test_pallas_btp.py: same
losses as kernels=xla). GPU (compiled Triton) and kernels=xla keep check_vma=True.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from boost_jax.layers.attention import causal_attention
from boost_jax.layers.model import RESIDUAL_NAME
from boost_jax.layers.rope import apply_rope
from boost_jax.pallas import dispatch

# checkpoint_name of every TP-reduced latent (the outputs of the chunk-boundary all-reduces and
# the Online-RMSNorm statistic); remat="lowrank" saves these plus the residual shard.
TP_LATENT_NAME = "tp_latent"
LOWRANK_TP_POLICY = jax.checkpoint_policies.save_only_these_names(TP_LATENT_NAME, RESIDUAL_NAME)


@dataclass(frozen=True)
class TPContext:
    mode: str  # megatron | vanilla | btp
    kind: str  # model arch: full | svd | cola | lax
    axes: tuple[str, ...]  # TP mesh axes (manual inside the shard_map)
    t: int  # TP degree
    d: int
    d_ff: int
    r: int
    n_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_theta: float
    dtype: jnp.dtype  # compute dtype
    remat: str  # none | full | lowrank
    tie: bool
    kernels: str  # resolved implementation for the fused kernels: xla | pallas
    promote_bf16_reduce: bool  # CPU: all-reduce 16-bit floats in fp32 (see psum below)
    check_vma: bool = True  # False only for interpreted Pallas kernels (btp, no GPU): see above

    @property
    def lax(self) -> bool:
        return self.kind == "lax"


def make_context(cfg, mesh) -> TPContext:
    m, par = cfg.model, cfg.parallel
    axes = tuple(par.tp_axes)
    t = int(np.prod([mesh.shape[a] for a in axes]))
    kernels = dispatch.resolve(par.kernels)
    return TPContext(
        mode=par.tp_mode, kind=m.arch, axes=axes, t=t, d=m.d_model, d_ff=m.d_ff, r=m.r,
        n_heads=m.n_heads, kv_heads=m.kv_heads, head_dim=m.head_dim, vocab=m.vocab_size,
        eps=m.norm_eps, rope_theta=m.rope_theta, dtype=jnp.dtype(m.dtype),
        remat=cfg.train.remat, tie=m.tie_embeddings, kernels=kernels,
        promote_bf16_reduce=jax.default_backend() == "cpu",
        # only btp calls the kernels (dispatch.online_rmsnorm_matmul, dispatch.grouped_up)
        check_vma=par.tp_mode != "btp" or dispatch.shard_map_check_vma(par.kernels))


def tp_shard_map(ctx: TPContext, f: Callable, mesh, in_specs, out_specs) -> Callable:
    """jax.shard_map(f) over ctx.axes (manual; the other mesh axes stay automatic) with
    check_vma=ctx.check_vma.

    With check_vma=False on CPU, 16-bit float arguments cross the shard_map boundary in fp32
    (cast back to their dtype first thing inside, so the forward is bit-identical): the
    untyped transpose psums the cotangent of each TP-replicated argument in its dtype at the
    boundary, and XLA:CPU crashes promoting a 16-bit all-reduce in a partial-auto shard_map
    (see psum below). With check_vma=True those reductions are our own psums, already fp32.
    """
    def smap(fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=frozenset(ctx.axes), check_vma=ctx.check_vma)

    if ctx.check_vma or not ctx.promote_bf16_reduce:
        return smap(f)

    def call(*args):
        dtypes = [x.dtype for x in jax.tree.leaves(args)]
        tree = jax.tree.structure(args)

        def body(*wide):
            leaves = [x.astype(dt) for x, dt in zip(jax.tree.leaves(wide), dtypes)]
            return f(*jax.tree.unflatten(tree, leaves))

        wide = [x.astype(jnp.float32) if _promote(ctx, x) else x for x in jax.tree.leaves(args)]
        return smap(body)(*jax.tree.unflatten(tree, wide))

    return call


# --------------------------------------------------------------------------- collectives


def _promote(ctx: TPContext, x):
    return ctx.promote_bf16_reduce and jnp.dtype(x.dtype).itemsize < 4 and \
        jnp.issubdtype(x.dtype, jnp.floating)


def psum(ctx: TPContext, x):
    """All-reduce over the TP axes (a pytree: JAX emits one all-reduce per array, which XLA's
    all-reduce combiner — on by default on CPU and GPU — merges into one variadic op).

    On CPU, XLA promotes 16-bit all-reduces to fp32 anyway (AllReducePromotion) and crashes
    doing so inside a partial-auto shard_map (the reduction region holds a sharding
    constraint); we promote explicitly there. GPU/TPU reduce in the compute dtype.
    """
    leaves, tree = jax.tree.flatten(x)
    dts = [l.dtype for l in leaves]
    leaves = [l.astype(jnp.float32) if _promote(ctx, l) else l for l in leaves]
    out = jax.lax.psum(tuple(leaves), ctx.axes)
    out = [o.astype(dt) for o, dt in zip(out, dts)]
    return jax.tree.unflatten(tree, out)


def all_gather(ctx: TPContext, x, axis: int):
    """Tiled all-gather over the TP axes, as ONE all-reduce of the zero-padded shard.

    Exact (each position sums one value and zeros) and replicated-typed, so its transpose is
    free and the consumer's pcast carries the backward reduction. Not lax.all_gather: inside
    a partial-auto shard_map XLA's SPMD partitioner first all-gathers the operand over the
    automatic (data-parallel) axes — the whole batch — before an all-gather or reduce-scatter
    over manual axes (all-reduce is partitioned properly). Costs 2(t-1)/t instead of (t-1)/t
    of the payload; used once per step (head, tied embedding) and by vanilla LaX.
    """
    axis = axis % x.ndim
    n = x.shape[axis]
    shape = x.shape[:axis] + (n * ctx.t,) + x.shape[axis + 1:]
    z = jnp.zeros(shape, x.dtype)
    return psum(ctx, jax.lax.dynamic_update_slice_in_dim(z, x, rank_index(ctx) * n, axis))


def local_slice(ctx: TPContext, x, axis: int):
    """This rank's 1/t slice of a replicated x along `axis`: no communication forward; the
    backward all-reduces the (zero-padded) slice cotangents through the explicit pcast."""
    n = x.shape[axis] // ctx.t
    return jax.lax.dynamic_slice_in_dim(to_varying(ctx, x), rank_index(ctx) * n, n, axis)


def to_varying(ctx: TPContext, x):
    """Mark an invariant value as entering per-rank compute: identity forward, all-reduce of the
    cotangent backward (Megatron's f). No-op for values already varying."""
    missing = tuple(a for a in ctx.axes if a not in varying_axes(x))
    if not missing:
        return x
    if _promote(ctx, x):  # its transpose is a psum: keep 16-bit floats out of it on CPU
        return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)
    return jax.lax.pcast(x, missing, to="varying")


def varying_axes(x) -> frozenset:
    """Manual axes along which x may differ between ranks (its vma type)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def rank_index(ctx: TPContext):
    """Linear index of this rank over the TP axes, major-to-minor as in P((ax0, ax1, ...))."""
    return jax.lax.axis_index(ctx.axes)


# --------------------------------------------------------------------------- local compute


def matmul(x, w, dtype):
    return jnp.matmul(x.astype(dtype), w.astype(dtype))


def local_attention(ctx: TPContext, q, k, v, positions, n_heads: int, n_kv: int):
    """RoPE + causal attention on the given heads; q [b,s,n_heads·hd], k/v [b,s,n_kv·hd]."""
    b, s = q.shape[:2]
    hd = ctx.head_dim
    q = apply_rope(q.reshape(b, s, n_heads, hd), positions, ctx.rope_theta)
    k = apply_rope(k.reshape(b, s, n_kv, hd), positions, ctx.rope_theta)
    v = v.reshape(b, s, n_kv, hd)
    return causal_attention(q, k, v).reshape(b, s, n_heads * hd)


def name_latent(x):
    return checkpoint_name(x, TP_LATENT_NAME)


def name_residual(x):
    return checkpoint_name(x, RESIDUAL_NAME)


# --------------------------------------------------------------------------- layers


def remat_block(fn: Callable, remat: str) -> Callable:
    if remat == "full":
        return jax.checkpoint(fn, prevent_cse=False)
    if remat == "lowrank":
        return jax.checkpoint(fn, policy=LOWRANK_TP_POLICY, prevent_cse=False)
    if remat != "none":
        raise ValueError(f"train.remat={remat!r}; expected none, full or lowrank")
    return fn


def is_stacked(blocks: dict) -> bool:
    """Stacked (scan_layers=True) blocks are keyed by name; unstacked by layer index."""
    return not all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in blocks)


def run_layers(ctx: TPContext, block_fn: Callable, blocks: dict, h, positions,
               prev: Optional[dict]):
    """Apply block_fn(params, h, positions, prev) -> (h, prev) over all layers.

    Stacked params run under lax.scan (one compiled layer); per-layer dicts in a Python loop.
    """
    fn = remat_block(block_fn, ctx.remat)
    if is_stacked(blocks):
        def body(carry, p):
            return fn(p, carry[0], positions, carry[1]), None

        (h, prev), _ = jax.lax.scan(body, (h, prev), blocks)
        return h, prev
    for key in sorted(blocks, key=int):
        h, prev = fn(blocks[key], h, positions, prev)
    return h, prev
