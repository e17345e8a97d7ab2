"""Helpers shared by the Pallas kernels (rmsnorm.py, grouped.py): tile sizes, Triton
parameters, in-kernel matmul, flattening, and the varying-axes (vma) alignment that lets a
kernel run inside jax.shard_map with check_vma=True."""

from __future__ import annotations

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
