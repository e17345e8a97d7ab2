"""Causal self-attention with GQA: the score/softmax math and the q, k, v, o projections' params
(LowRankLinear of the model's arch). The sub-layer itself is boost_jax.layers.forward.attention."""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.layers.linear import LowRankLinear


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, offset=None) -> jax.Array:
    """softmax(q·kᵀ/√hd + causal) · v with GQA.

    q [b, sq, H, hd]; k, v [b, sk, K, hd] with K | H (query head h uses kv head h // (H/K)).
    Query i sits at key position offset + i and sees keys 0..offset + i. By default
    offset = sk - sq: when sq < sk the queries are the last sq positions (KV-cache style).
    A fixed-size KV cache passes the number of keys filled before these queries (may be
    traced), so the unfilled slots after them are masked.
    Scores and softmax in fp32; the full [sq, sk] score matrix is computed and masked, which
    is also what flops.py counts.
    """
    b, sq, H, hd = q.shape
    sk, K = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, K, H // K, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    offset = sk - sq if offset is None else offset
    mask = (jnp.arange(sq)[:, None] + offset) >= jnp.arange(sk)[None, :]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, sq, H, hd)


class Attention(nnx.Module):
    """Params: q/k/v/o each a LowRankLinear (see linear.py for their param names)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, hd
        self.rope_theta = cfg.rope_theta
        mk = lambda i, o: LowRankLinear.from_config(cfg, i, o, rngs=rngs)  # noqa: E731
        self.q = mk(d, cfg.n_heads * hd)
        self.k = mk(d, cfg.kv_heads * hd)
        self.v = mk(d, cfg.kv_heads * hd)
        self.o = mk(cfg.n_heads * hd, d)
