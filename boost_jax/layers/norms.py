"""RMSNorm: statistics in fp32 whatever the compute dtype (bf16 mean-of-squares loses digits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6, dtype=None) -> jax.Array:
    """x / sqrt(mean(x², -1) + eps) · scale, computed in fp32, returned in `dtype` (default x.dtype)."""
    out_dtype = dtype or x.dtype
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * scale.astype(jnp.float32)).astype(out_dtype)


class RMSNorm(nnx.Module):
    """Param `scale` [dim], initialised to ones."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, dtype=None):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.dtype)
