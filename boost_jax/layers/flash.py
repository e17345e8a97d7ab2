"""Blockwise causal attention (online softmax) whose backward also works block by block.

Same contract as forward.dense_attention: q [b, sq, H, hd], k, v [b, sk, K, hd] (GQA: query
head h reads kv head h // (H/K)), query i at key position offset + i. Nothing of size [sq, sk]
is ever built: the forward walks q tiles (lax.scan) and, for each, the kv tiles it can see
(a fori_loop that stops at the causal diagonal), keeping a running max m, sum l and output
accumulator (FlashAttention's online softmax); it saves only the output and the row
log-sum-exp. The backward (custom_vjp) walks kv tiles and, for each, the q tiles that see it,
recomputing the tile's probabilities from the saved log-sum-exp (FlashAttention-2).

Lengths that are not a multiple of the tile are zero-padded; padded keys are masked and padded
query rows are dropped. Runs anywhere XLA does (the CPU path, and the decoder's path on GPUs).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from boost_jax.pallas.common import align_vma

BLOCK = 256  # q and kv tile; tests shrink it to force several tiles and padding
F32 = jnp.float32
NEG = float(jnp.finfo(F32).min)  # finite: a masked score never makes inf - inf


def flash_attention(q, k, v, offset=None, block: int | None = None):
    """softmax(q·kᵀ/√hd + causal) · v in tiles of `block` (default BLOCK)."""
    b, sq, H, hd = q.shape
    sk, K = k.shape[1], k.shape[2]
    blk = block or BLOCK
    bq, bk = min(blk, sq), min(blk, sk)
    off = jnp.asarray(sk - sq if offset is None else offset, jnp.int32)
    q, k, v = align_vma(q, k, v)
    qb = _tiles(q.reshape(b, sq, K, H // K, hd), bq, (0, 2, 3, 1, 4))  # [nq, b, K, G, bq, hd]
    kb = _tiles(k, bk, (0, 2, 1, 3))  # [nk, b, K, bk, hd]
    vb = _tiles(v, bk, (0, 2, 1, 3))
    out = _flash(qb, kb, vb, off, sk)  # [nq, b, K, G, bq, hd]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, -1, H, hd)
    return out[:, :sq]  # padded query rows dropped


def _tiles(x, t: int, perm):
    """[b, s, ...] → zero-padded to a multiple of t along s → [n, tile [b, t, ...] permuted]."""
    s = x.shape[1]
    n = -(-s // t)
    x = jnp.pad(x, [(0, 0), (0, n * t - s)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], n, t, *x.shape[2:])  # [b, n, t, ...]
    x = jnp.moveaxis(x, 1, 0)  # [n, b, t, ...]
    return jnp.transpose(x, (0,) + tuple(p + 1 for p in perm))


def _scores(qi, kj, i, j, off, sk: int):
    """Masked fp32 scores [b, K, G, bq, bk] of q tile i against kv tile j."""
    bq, bk, hd = qi.shape[-2], kj.shape[-2], qi.shape[-1]
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=F32) / math.sqrt(hd)
    rows = i * bq + jnp.arange(bq) + off
    cols = j * bk + jnp.arange(bk)
    mask = (rows[:, None] >= cols[None, :]) & (cols < sk)[None, :]
    return jnp.where(mask, s, NEG)


def _last_kv_tile(i, off, bq: int, bk: int, nk: int):
    """One past the last kv tile q tile i sees (at least 1: key 0 is visible to every row)."""
    return jnp.clip((i * bq + bq - 1 + off) // bk + 1, 1, nk)


def _first_q_tile(j, off, bq: int, bk: int):
    """The first q tile that sees kv tile j (its last row bq·i + bq - 1 + off reaches j·bk)."""
    return jnp.maximum(0, (j * bk - off) // bq)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(qb, kb, vb, off, sk: int):
    return _forward(qb, kb, vb, off, sk)[0]


def _forward(qb, kb, vb, off, sk: int):
    """→ (out tiles in q's dtype, row log-sum-exp [nq, b, K, G, bq] fp32)."""
    nk, bq, bk = kb.shape[0], qb.shape[-2], kb.shape[-2]

    def q_tile(_, x):
        qi, i = x
        zero = jnp.zeros_like(qi[..., 0], F32)

        def kv_tile(j, c):
            m, l, acc = c
            vj = vb[j]
            s = _scores(qi, kb[j], i, j, off, sk)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            a = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vj.dtype), vj,
                            preferred_element_type=F32)
            return m_new, a * l + p.sum(-1), a[..., None] * acc + pv

        init = (zero + NEG, zero, jnp.zeros_like(qi, F32))
        m, l, acc = lax.fori_loop(0, _last_kv_tile(i, off, bq, bk, nk), kv_tile, init)
        return None, ((acc / l[..., None]).astype(qi.dtype), m + jnp.log(l))

    _, (out, lse) = lax.scan(q_tile, None, (qb, jnp.arange(qb.shape[0])))
    return out, lse


def _flash_fwd(qb, kb, vb, off, sk: int):
    out, lse = _forward(qb, kb, vb, off, sk)
    return out, (qb, kb, vb, off, out, lse)


def _flash_bwd(sk: int, res, dout):
    qb, kb, vb, off, out, lse = res
    nq, bq, bk = qb.shape[0], qb.shape[-2], kb.shape[-2]
    delta = jnp.sum(dout.astype(F32) * out.astype(F32), -1)  # rowsum(dO ∘ O) [nq, b, K, G, bq]
    scale = 1.0 / math.sqrt(qb.shape[-1])

    def kv_tile(dq, x):
        kj, vj, j = x

        def q_tile(i, c):
            dk, dv, dq = c
            qi, doi = qb[i], dout[i]
            p = jnp.exp(_scores(qi, kj, i, j, off, sk) - lse[i][..., None])
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(doi.dtype), doi,
                                 preferred_element_type=F32)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj, preferred_element_type=F32)
            ds = p * (dp - delta[i][..., None]) * scale
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qi.astype(F32))
            dqi = jnp.einsum("bkgqs,bksd->bkgqd", ds, kj.astype(F32))
            return dk, dv, dq.at[i].add(dqi)

        first = _first_q_tile(j, off, bq, bk)
        init = (jnp.zeros_like(kj, F32), jnp.zeros_like(vj, F32), dq)
        dk, dv, dq = lax.fori_loop(first, nq, q_tile, init)
        return dq, (dk.astype(kj.dtype), dv.astype(vj.dtype))

    dq0 = jnp.zeros_like(qb, F32)
    dq, (dk, dv) = lax.scan(kv_tile, dq0, (kb, vb, jnp.arange(kb.shape[0])))
    return dq.astype(qb.dtype), dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)
