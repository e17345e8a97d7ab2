"""Helpers shared by the Pallas kernels (rmsnorm.py, layernorm.py, grouped.py, flash.py): tile
sizes, Triton parameters, in-kernel matmul, flattening, the varying-axes (vma) alignment that
lets a kernel run inside jax.shard_map with check_vma=True, and the row-norm plumbing (tiles,
pallas_call, custom VJP, the [..., n] wrapper) the two local-norm kernels share."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32


def pow2(n: int, lo: int = 16) -> int:
    """Next power of two >= n (Triton tiles must be powers of two; tl.dot wants >= 16)."""
    return max(lo, pl.next_power_of_2(int(n)))


def triton_params(num_warps: int = 4, num_stages: int = 2):
    # Triton compiler params select the Triton lowering (JAX 0.10 otherwise picks Mosaic GPU).
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def mm(a, b, contract=((1,), (0,))):
    """2-D dot with fp32 accumulation; fp32 inputs use IEEE (no TF32) so tests stay exact."""
    prec = lax.Precision.HIGHEST if a.dtype == F32 else None
    return lax.dot_general(a, b, (contract, ((), ())), precision=prec,
                           preferred_element_type=F32)


def flat(x):
    return x.reshape(-1, x.shape[-1])


def _varying(x):
    return jax.typeof(x).manual_axis_type.varying


def align_vma(*xs):
    """Inside shard_map(check_vma=True): pcast operands to one common varying set, so kernel
    outputs can declare it; pcast's transpose (psum) then fixes grads of replicated operands.
    A no-op outside shard_map or with check_vma=False."""
    v = frozenset().union(*map(_varying, xs))
    return tuple(lax.pcast(x, tuple(sorted(v - _varying(x))), to="varying")
                 if v - _varying(x) else x for x in xs)


def sds(shape, dtype, like):
    """Output ShapeDtypeStruct carrying `like`'s manual-axis type (check_vma needs it)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


# ---------------------------------------------------------------- row norms (rmsnorm, layernorm)
def norm_blocks(T: int, d: int):
    """(bt, bd, num_warps) of a row-norm kernel over [T, d]: one [bt, bd] tile per program."""
    bd = pow2(d)
    bt = max(1, min(64, 8192 // bd, pow2(T, 1)))  # keep a [bt, bd] tile in registers
    return bt, bd, (4 if bt * bd <= 4096 else 8)


def tile_masks(T: int, d: int, bt: int, bd: int):
    """Row, column and tile masks of this program's [bt, bd] tile (ragged edges masked)."""
    rows = pl.program_id(0) * bt + jnp.arange(bt)
    cols = jnp.arange(bd)
    rm, cm = rows < T, cols < d
    return rm, cm, rm[:, None] & cm[None, :]


def norm_call(x, eps, interpret, kernel, ins, outs, name):
    """pallas_call of a row-norm `kernel` (static T, d, eps, bt, bd) over x [T, d]'s row tiles;
    `ins`/`outs` name each operand's block: row [bt, bd], vec [bt], gam [bd] (the whole γ),
    part [bd] (one row per tile: per-tile partial sums). Call the result with out_shape=."""
    T, d = x.shape
    bt, bd, nw = norm_blocks(T, d)
    row, vec = pl.BlockSpec((bt, bd), lambda i: (i, 0)), pl.BlockSpec((bt,), lambda i: (i,))
    specs = {"row": row, "vec": vec, "gam": pl.BlockSpec((bd,), lambda i: (0,)),
             "part": pl.BlockSpec((None, bd), lambda i: (i, 0))}
    return partial(pl.pallas_call, partial(kernel, T=T, d=d, eps=eps, bt=bt, bd=bd),
                   grid=(pl.cdiv(T, bt),), in_specs=[specs[k] for k in ins],
                   out_specs=tuple(specs[k] for k in outs), compiler_params=triton_params(nw),
                   interpret=interpret, name=name)


def norm_calls(fwd_kernel, bwd_kernel, stats: int, name: str):
    """(fwd_call, bwd_call) for norm_vjp: the forward kernel writes x̂ and `stats` per-row fp32
    statistics; the backward reads x, γ, gx̂ and the statistics' cotangents and writes dx and
    dγ partials per token block, summed here (deterministic, no atomics)."""
    vecs = ("vec",) * stats

    def fwd_call(x, g, eps, interpret):
        T, d = x.shape
        call = norm_call(x, eps, interpret, fwd_kernel, ("row", "gam"), ("row", *vecs),
                         f"{name}_fwd")
        return call(out_shape=(sds((T, d), x.dtype, x), *(sds((T,), F32, x),) * stats))(x, g)

    def bwd_call(x, g, *args):
        *cts, eps, interpret = args
        T, d = x.shape
        nb = pl.cdiv(T, norm_blocks(T, d)[0])
        call = norm_call(x, eps, interpret, bwd_kernel, ("row", "gam", "row", *vecs),
                         ("row", "part"), f"{name}_bwd")
        dx, dgp = call(out_shape=(sds((T, d), x.dtype, x), sds((nb, d), F32, x)))(x, g, *cts)
        return dx, jnp.sum(dgp, axis=0).astype(g.dtype)

    return fwd_call, bwd_call


def norm_vjp(fwd_call, bwd_call):
    """fwd_call(x, g, eps, interpret) -> (x̂, *per-row statistics) as a custom_vjp (eps and
    interpret static) whose backward is bwd_call(x, g, gx̂, *statistics' cotangents in fp32,
    eps, interpret) -> (dx, dg): x is saved, x̂ recomputed."""

    @partial(jax.custom_vjp, nondiff_argnums=(2, 3))
    def norm(x, g, eps, interpret):
        return fwd_call(x, g, eps, interpret)

    def norm_fwd(x, g, eps, interpret):
        return fwd_call(x, g, eps, interpret), (x, g)

    def norm_bwd(eps, interpret, res, cts):
        x, g = res
        return bwd_call(x, g, cts[0], *(c.astype(F32) for c in cts[1:]), eps, interpret)

    norm.defvjp(norm_fwd, norm_bwd)
    return norm


def local_norm(norm, x, gamma, eps: float, interpret: bool):
    """`norm` (from norm_vjp) on x [..., n] as rows: (x̂ [..., n] x.dtype, *statistics [...])."""
    lead = x.shape[:-1]
    x, gamma = align_vma(x, gamma)
    outs = norm(flat(x), gamma, float(eps), bool(interpret))
    return outs[0].reshape(x.shape), *(o.reshape(lead) for o in outs[1:])
