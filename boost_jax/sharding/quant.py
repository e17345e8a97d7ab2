"""Symmetric int8 block quantization (one fp32 scale per block) for low-bandwidth weight gathers.

Layout: `axis` (default the last) is split into blocks of `block` elements, padded with zeros
to a whole number of blocks; all other axes are untouched. So quantizing the local shard of an
array sharded on any other axis stays local, and gathering `q` and `scale` along such an axis
is the same as gathering the weight.

    q, s = quantize(x, 256)            # q: x.shape[:-1] + (nb, 256) int8, s: x.shape[:-1] + (nb,)
    y = dequantize(q, s, x.shape, x.dtype)

scale = max|block| / 127 and q = round(x / scale), so |y − x| ≤ scale / 2 = max|block| / 254
per element (plus the rounding of the output dtype). Payload: 1 byte per element + 4 bytes
per block, ≈ 0.51× bf16 at block 256.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp

DEFAULT_BLOCK = 256
QMAX = 127.0


def _blocks(n: int, block: int) -> int:
    return max(1, math.ceil(n / block))


@functools.partial(jax.jit, static_argnames=("block", "axis"))  # one dispatch when eager
def quantize(x: jax.Array, block: int = DEFAULT_BLOCK, axis: int = -1):
    """x → (q int8 [..., nb, block], scale fp32 [..., nb]) with `axis` moved last and blocked."""
    if block <= 0:
        raise ValueError(f"block={block} must be > 0")
    if x.ndim == 0:
        x = x.reshape(1)
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    nb = _blocks(n, block)
    xf = x.astype(jnp.float32)
    if nb * block != n:  # zero padding never raises a block's max, so scales are unchanged
        xf = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - n)])
    xb = xf.reshape(x.shape[:-1] + (nb, block))
    scale = jnp.max(jnp.abs(xb), axis=-1) / QMAX
    safe = jnp.where(scale > 0, scale, 1.0)  # all-zero block: q = 0, scale = 0
    q = jnp.clip(jnp.round(xb / safe[..., None]), -QMAX, QMAX).astype(jnp.int8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, shape: Sequence[int], dtype=jnp.float32,
               axis: int = -1) -> jax.Array:
    """Inverse of quantize: `shape` is the original shape (it fixes the padding to drop)."""
    return _dequantize(q, scale, tuple(int(d) for d in shape), jnp.dtype(dtype), int(axis))


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "axis"))
def _dequantize(q, scale, shape, dtype, axis):
    orig = tuple(shape)
    shape = orig or (1,)
    axis = axis % len(shape)
    y = q.astype(jnp.float32) * scale[..., None]
    y = y.reshape(q.shape[:-2] + (q.shape[-2] * q.shape[-1],))[..., : shape[axis]]
    return jnp.moveaxis(y, -1, axis).astype(dtype).reshape(orig)


def payload_bytes(shape: Sequence[int], block: int = DEFAULT_BLOCK, axis: int = -1) -> int:
    """Bytes of q + scales for a tensor of `shape` (what a quantized gather moves)."""
    shape = tuple(shape) or (1,)
    n = shape[axis]
    rest = math.prod(shape) // n
    nb = _blocks(n, block)
    return rest * nb * (block + 4)


def pack(q: jax.Array, scale: jax.Array) -> jax.Array:
    """(q [..., nb, k] int8 or uint8, scale fp32 [..., nb]) → one uint8 buffer [..., nb, k + 4]
    with each block's scale bytes after it: one collective moves both (a layer's packed
    buffers then travel in one call, sharding/bucket.py)."""
    qb = q if q.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(q, jnp.uint8)
    return jnp.concatenate([qb, jax.lax.bitcast_convert_type(scale, jnp.uint8)], axis=-1)


def unpack(buf: jax.Array, q_dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """Inverse of pack: (q in q_dtype, scale fp32)."""
    q = buf[..., :-4]
    if jnp.dtype(q_dtype) != jnp.uint8:
        q = jax.lax.bitcast_convert_type(q, q_dtype)
    return q, jax.lax.bitcast_convert_type(buf[..., -4:], jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fake_quant(x: jax.Array, block: int = DEFAULT_BLOCK, axis: int = -1) -> jax.Array:
    """Quantize-dequantize round trip with a straight-through (identity) gradient."""
    q, s = quantize(x, block, axis)
    return dequantize(q, s, x.shape, x.dtype, axis)


def _fq_fwd(x, block, axis):
    return fake_quant(x, block, axis), None


def _fq_bwd(block, axis, _, g):
    return (g,)


fake_quant.defvjp(_fq_fwd, _fq_bwd)


def quantized_all_gather(x: jax.Array, axis_name, *, axis: int = 0, block: int = DEFAULT_BLOCK,
                         quant_axis: int = -1, dtype=None) -> jax.Array:
    """Inside shard_map: tiled all-gather of `x` along `axis` that moves int8 + scales.

    Each shard is quantized locally (blocks along `quant_axis`), q and scales are packed and
    gathered stacked (so per-shard padding never interleaves), then dequantized. The gradient
    is the exact transpose of a tiled all-gather (psum_scatter), straight-through the
    quantization."""
    y = _qag(x, axis_name, axis, block, quant_axis)
    return y if dtype is None else y.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _qag(x, axis_name, axis, block, quant_axis):
    qg, sg = unpack(jax.lax.all_gather(pack(*quantize(x, block, quant_axis)), axis_name,
                                       axis=0, tiled=False))
    n = qg.shape[0]
    qa = quant_axis % max(x.ndim, 1)
    y = dequantize(qg, sg, (n,) + (x.shape or (1,)), x.dtype, axis=qa + 1)
    y = jnp.moveaxis(y, 0, axis % max(x.ndim, 1))
    ax = axis % max(x.ndim, 1)
    shape = list(y.shape)
    merged = shape[:ax] + [shape[ax] * shape[ax + 1]] + shape[ax + 2:]
    return y.reshape(merged)


def _qag_fwd(x, axis_name, axis, block, quant_axis):
    return _qag(x, axis_name, axis, block, quant_axis), None


def _qag_bwd(axis_name, axis, block, quant_axis, _, g):
    return (jax.lax.psum_scatter(g, axis_name, scatter_dimension=axis, tiled=True),)


_qag.defvjp(_qag_fwd, _qag_bwd)


@functools.partial(jax.jit, static_argnames=("block", "axis"))
def max_error_bound(x: jax.Array, block: int = DEFAULT_BLOCK, axis: int = -1) -> jax.Array:
    """Per-element bound max|block|/254 in x's shape (scale/2 laid out like the data)."""
    q, s = quantize(x, block, axis)
    return dequantize(jnp.ones(q.shape, jnp.int8), s * 0.5, jnp.shape(x), jnp.float32, axis)


__all__ = ["quantize", "dequantize", "fake_quant", "quantized_all_gather", "payload_bytes",
           "max_error_bound", "pack", "unpack", "DEFAULT_BLOCK"]


# --------------------------------------------------------------------------- int4 (qgZ)

QMAX4 = 7.0


def quantize_int4(x: jax.Array, block: int = DEFAULT_BLOCK):
    """x [..., m] → (packed uint8 [..., nb, block/2], scale fp32 [..., nb]): symmetric int4 per
    block of `block` (even) elements along the last axis, two values per byte (low nibble
    first), stored as q + 8 in 1..15. |dequantize − x| ≤ scale/2 = max|block| / 14."""
    if block <= 0 or block % 2:
        raise ValueError(f"block={block} must be a positive even number")
    m = x.shape[-1]
    nb = _blocks(m, block)
    xf = x.astype(jnp.float32)
    if nb * block != m:
        xf = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - m)])
    xb = xf.reshape(x.shape[:-1] + (nb, block))
    scale = jnp.max(jnp.abs(xb), axis=-1) / QMAX4
    safe = jnp.where(scale > 0, scale, 1.0)
    q = (jnp.clip(jnp.round(xb / safe[..., None]), -QMAX4, QMAX4) + 8).astype(jnp.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale


def dequantize_int4(packed: jax.Array, scale: jax.Array, m: int) -> jax.Array:
    """Inverse of quantize_int4 → fp32 [..., m]."""
    lo = (packed & 0xF).astype(jnp.float32) - 8
    hi = (packed >> 4).astype(jnp.float32) - 8
    q = jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
    y = q * scale[..., None]
    return y.reshape(y.shape[:-2] + (-1,))[..., :m]


def payload_bytes_int4(m: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of packed int4 + fp32 scales for m elements (what a qgZ all-to-all moves)."""
    nb = _blocks(m, block)
    return nb * (block // 2 + 4)
