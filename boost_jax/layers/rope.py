"""Rotary position embeddings (half-split "rotate_half" convention, as in HF LLaMA / MaxText).

Pure functions of explicit `positions`, so a sequence-sharded caller (each shard holds an
offset slice of the sequence) or a decoder with a KV cache passes its own absolute positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> jax.Array:
    """Inverse frequencies theta^(-2i/head_dim), i < head_dim/2, fp32."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float = 10000.0):
    """cos, sin of shape positions.shape + [head_dim/2] (fp32)."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(head_dim, theta)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotate x [b, s, heads, head_dim] by `positions` ([s] or [b, s]); fp32 math, x.dtype out.

    Pair (x[i], x[i + head_dim/2]) is rotated by angle pos·theta^(-2i/head_dim).
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    if cos.ndim == 2:  # [s, hd/2] → broadcast over batch
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rotary(x: jax.Array, positions: jax.Array, theta: float, dims: int) -> jax.Array:
    """RoPE on the leading `dims` of each head (GPT-NeoX's rotary_pct), the rest passed through;
    frequencies as for a head of size `dims`. dims=0: x unchanged (learned positions)."""
    if dims == 0:
        return x
    if dims == x.shape[-1]:
        return apply_rope(x, positions, theta)
    rot = apply_rope(x[..., :dims], positions, theta)
    return jnp.concatenate([rot, x[..., dims:]], axis=-1)
