"""Flash attention as a Pallas (Triton) kernel, forward and backward: ROCm, and NVIDIA where
cuDNN's fused attention does not apply (boost_jax/layers/attention.py decides).

The kernels are JAX's own maintained ones (jax.experimental.pallas.ops.gpu.attention: the
FlashAttention-2 forward, a dK/dV kernel and a dQ kernel, custom_vjp); this file fits them to
the model's contract, the one of layers.attention.dense_attention for sq = sk:

  * GQA: kv heads are repeated to the query heads (autodiff sums their gradients back), an
    O(s·H·hd) copy, never O(s²);
  * any length: q, k, v are zero-padded to a whole number of tiles. Under the causal mask a
    real query never sees a padded key (padded keys come after every real position), and the
    padded query rows are dropped, so their zero cotangents add nothing to dK, dV;
  * shard_map: operands are pcast to one varying set (align_vma) so the kernel's outputs, typed
    like q, carry it.
Interpret mode (CPU) runs the same kernels in JAX's Pallas interpreter: tests/test_pallas_flash.py.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as jax_flash

from boost_jax.pallas.common import align_vma, pow2

TILE = 64  # q and kv tile, forward and backward (64x64 bf16 tiles fit any GPU's shared memory)


def tile_for(s: int, tile: int | None = None) -> int:
    """The tile for s positions: TILE, or the power of two >= s (at least 16, tl.dot's minimum)."""
    return min(tile or TILE, pow2(s))


def flash_attention(q, k, v, *, interpret: bool = False, tile: int | None = None):
    """Causal softmax(q·kᵀ/√hd)·v; q [b, s, H, hd], k, v [b, s, K, hd] with K | H."""
    b, s, H, hd = q.shape
    if k.shape[1] != s:
        raise ValueError(f"the Pallas flash kernel needs as many keys as queries (got {s} "
                         f"queries, {k.shape[1]} keys); the KV-cache decoder uses the "
                         "blockwise path")
    q, k, v = align_vma(q, k, v)
    rep = H // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    t = tile_for(s, tile)
    pad = [(0, 0), (0, -s % t), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    blocks = jax_flash.BlockSizes(block_q=t, block_k=t, block_q_dkv=t, block_kv_dkv=t,
                                  block_q_dq=t, block_kv_dq=t)
    out = jax_flash.mha(q, k, v, None, sm_scale=1.0 / math.sqrt(hd), causal=True,
                        block_sizes=blocks, interpret=interpret)
    return out[:, :s]
