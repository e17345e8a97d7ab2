"""What the three tensor-parallel layouts (megatron, vanilla, btp) share: the context and the TP
collectives (the ops they inherit are ops.TPOps).

Everything here runs inside the training step's shard_map, manual over every mesh axis, with
check_vma=True: JAX types each value as invariant (identical on all TP ranks) or varying,
inserts `pcast(..., to="varying")` where an invariant value meets a varying one, and transposes
psum ↔ pcast, so backward collectives sit exactly where the Megatron f/g operators put them.
We place some pcasts explicitly so that one backward all-reduce covers a whole group of
projections instead of one per matmul. (The one exception, Pallas kernels in the interpreter,
is boost_jax.backends.cpu.untyped_tp_grads.)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.layers.forward import latent_keys
from boost_jax.layers.linear import matmul  # the layouts' matmul is the model's
from boost_jax.backends.cpu import check_vma
from boost_jax.mesh import axis_size
from boost_jax.names import LATENT_NAME, REDUCED_NAME
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
