"""RMSNorm and LayerNorm: statistics in fp32 whatever the compute dtype (bf16 mean-of-squares loses digits)."""

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


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5,
               dtype=None) -> jax.Array:
    """(x − mean) / sqrt(var + eps) · scale + bias over the last axis, fp32 inside."""
    out_dtype = dtype or x.dtype
    xf = x.astype(jnp.float32)
    c = xf - jnp.mean(xf, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps)
    y = c * inv * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def apply_norm(x: jax.Array, p: dict, eps: float, dtype=None) -> jax.Array:
    """The norm whose params are `p`: LayerNorm when it has a bias, else RMSNorm."""
    if "bias" in p:
        return layer_norm(x, p["scale"], p["bias"], eps, dtype)
    return rms_norm(x, p["scale"], eps, dtype)


class RMSNorm(nnx.Module):
    """Param `scale` [dim], initialised to ones."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, dtype=None):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.dtype)


class LayerNorm(nnx.Module):
    """Params `scale` [dim] (ones) and `bias` [dim] (zeros)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32, dtype=None):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], self.eps, self.dtype)
