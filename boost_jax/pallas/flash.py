"""Flash attention as Pallas (Triton) kernels, forward and backward: ROCm, and NVIDIA where
cuDNN's fused attention does not apply (boost_jax/layers/forward.attention_impl decides).

FlashAttention-2, after JAX's example kernels (jax.experimental.pallas.ops.gpu.attention), whose
outputs cannot carry the varying-axes type a typed shard_map (the TP layouts) needs:
  forward   grid (q tile, batch, head): online softmax over the kv tiles up to the diagonal;
            writes the output and the row log-sum-exp
  backward  delta = rowsum(dO·O) in XLA; one kernel, grid (tile, batch, head): dK, dV of kv
            tile j over the q tiles from the diagonal on, then dQ of q tile j over the kv
            tiles up to it, recomputing probabilities from the log-sum-exp
and fitted to the model's contract (layers.forward.dense_attention, sq = sk):
  * GQA: kv heads are repeated to the query heads (autodiff sums their gradients back), an
    O(s·H·hd) copy, never O(s²);
  * any length: zero-padded to whole tiles. Under the causal mask a real query never sees a
    padded key (they come after every real position); padded query rows are dropped, so their
    zero cotangents add nothing to dK, dV;
  * shard_map: operands are pcast to one varying set (align_vma) and outputs declare it (sds).
Interpret mode (CPU) runs the same kernels in JAX's Pallas interpreter:
tests/unit/test_pallas_flash.py.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from boost_jax.pallas.common import F32, align_vma, mm, pow2, sds, triton_params

TILE = 64  # q and kv tile, forward and backward (64x64 bf16 tiles fit any GPU's shared memory)
# A kernel keeps its q, k, v (and, backward, dO and gradient) tiles in shared memory: 64 rows of
# an fp32 head dim of 128 fit an A100 and an H100; 64 rows of 256 (fp32, head dims 129-256)
# asked 213 KB of an A100's 167 KB and 295 KB of an H100's 232 KB: their tile is halved.
TILE_BYTES = 64 * 128 * 4


def tile_for(s: int, tile: int | None = None) -> int:
    """The tile for s positions: TILE, or the power of two >= s (at least 16, tl.dot's minimum)."""
    return min(tile or TILE, pow2(s))


def fit_tile(t: int, hd: int, dtype) -> int:
    """Tile t halved (to 16 at least) while its rows of the padded head dim hold more than
    TILE_BYTES."""
    while t > 16 and t * pow2(hd) * jnp.dtype(dtype).itemsize > TILE_BYTES:
        t //= 2
    return t


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
    t = fit_tile(tile_for(s, tile), hd, q.dtype)
    pad = [(0, 0), (0, -s % t), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    out = _flash(q, k, v, t, bool(interpret))
    return out[:, :s]


# ---------------------------------------------------------------- kernels
def _load(ref, rows, hd: int):
    """Rows `rows` (None: all) of a [rows, hdp] block; the head-dim padding reads as 0."""
    ref = ref if rows is None else ref.at[rows, :]
    return plt.load(ref, mask=(jnp.arange(ref.shape[-1]) < hd)[None, :], other=0.0)


def _causal(qi, kj, t: int):
    return (qi * t + jnp.arange(t))[:, None] >= (kj * t + jnp.arange(t))[None, :]


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, t, hd, scale):
    i = pl.program_id(0)
    q = _load(q_ref, None, hd)

    def kv_tile(j, c):
        acc, m, l = c
        kd = pl.ds(j * t, t)
        s = jnp.where(_causal(i, j, t), mm(q, _load(k_ref, kd, hd), ((1,), (1,))) * scale,
                      -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[:, None])
        a = jnp.exp(m - m_new)
        v = _load(v_ref, kd, hd)
        return a[:, None] * acc + mm(p.astype(v.dtype), v), m_new, a * l + p.sum(-1)

    init = (jnp.zeros((t, q_ref.shape[-1]), F32), jnp.full((t,), -jnp.inf, F32),
            jnp.zeros((t,), F32))
    acc, m, l = lax.fori_loop(0, i + 1, kv_tile, init)
    plt.store(o_ref, (acc / l[:, None]).astype(o_ref.dtype),
              mask=(jnp.arange(o_ref.shape[-1]) < hd)[None, :])
    lse_ref[...] = m + jnp.log(l)


def _bwd_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dl_ref, dq_ref, dk_ref, dv_ref, *,
                t, hd, scale):
    j, n = pl.program_id(0), q_ref.shape[0] // t
    hm = (jnp.arange(q_ref.shape[-1]) < hd)[None, :]
    kd = pl.ds(j * t, t)
    k, v = _load(k_ref, kd, hd), _load(v_ref, kd, hd)

    def probs(qt, kt, q, k, rows):  # probabilities of q tile qt against kv tile kt
        s = mm(q, k, ((1,), (1,))) * scale
        return jnp.where(_causal(qt, kt, t), jnp.exp(s - lse_ref[rows][:, None]), 0.0)

    def q_tile(i, c):  # dK, dV of kv tile j
        dk, dv = c
        rows = pl.ds(i * t, t)
        q, do = _load(q_ref, rows, hd), _load(do_ref, rows, hd)
        p = probs(i, j, q, k, rows)
        ds = p * (mm(do, v, ((1,), (1,))) - dl_ref[rows][:, None]) * scale
        return dk + mm(ds.astype(q.dtype), q, ((0,), (0,))), \
            dv + mm(p.astype(do.dtype), do, ((0,), (0,)))

    zero = jnp.zeros((t, q_ref.shape[-1]), F32)
    dk, dv = lax.fori_loop(j, n, q_tile, (zero, zero))
    plt.store(dk_ref, dk.astype(dk_ref.dtype), mask=hm)
    plt.store(dv_ref, dv.astype(dv_ref.dtype), mask=hm)

    rows = pl.ds(j * t, t)  # dQ of q tile j
    q, do = _load(q_ref, rows, hd), _load(do_ref, rows, hd)

    def kv_tile(i, dq):
        kd = pl.ds(i * t, t)
        k, v = _load(k_ref, kd, hd), _load(v_ref, kd, hd)
        p = probs(j, i, q, k, rows)
        ds = p * (mm(do, v, ((1,), (1,))) - dl_ref[rows][:, None]) * scale
        return dq + mm(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, j + 1, kv_tile, zero)
    plt.store(dq_ref, dq.astype(dq_ref.dtype), mask=hm)


# ---------------------------------------------------------------- calls
def _specs(t: int, S: int, hdp: int):
    tile = pl.BlockSpec((None, t, None, hdp), lambda i, b, h: (b, i, h, 0))
    whole = pl.BlockSpec((None, S, None, hdp), lambda i, b, h: (b, 0, h, 0))
    rows = pl.BlockSpec((None, None, S), lambda i, b, h: (b, h, 0))
    return tile, whole, rows


def _params(t: int, hd: int):
    return triton_params(4 if t * pow2(hd) <= 64 * 64 else 8, 2)


def _forward(q, k, v, t: int, interpret: bool):
    b, S, H, hd = q.shape
    tile, whole, _ = _specs(t, S, pow2(hd))
    return pl.pallas_call(
        partial(_fwd_kernel, t=t, hd=hd, scale=1.0 / math.sqrt(hd)),
        out_shape=(sds(q.shape, q.dtype, q), sds((b, H, S), F32, q)),
        grid=(S // t, b, H), in_specs=[tile, whole, whole],
        out_specs=(tile, pl.BlockSpec((None, None, t), lambda i, b, h: (b, h, i))),
        compiler_params=_params(t, hd), interpret=interpret, name="flash_attention_fwd",
    )(q, k, v)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, t: int, interpret: bool):
    return _forward(q, k, v, t, interpret)[0]


def _flash_fwd(q, k, v, t, interpret):
    out, lse = _forward(q, k, v, t, interpret)
    return out, (q, k, v, out, lse)


def _flash_bwd(t, interpret, res, do):
    q, k, v, out, lse = res
    b, S, H, hd = q.shape
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(F32), out.astype(F32))
    tile, whole, rows = _specs(t, S, pow2(hd))
    return pl.pallas_call(
        partial(_bwd_kernel, t=t, hd=hd, scale=1.0 / math.sqrt(hd)),
        out_shape=tuple(sds(x.shape, x.dtype, q) for x in (q, k, v)),
        grid=(S // t, b, H), in_specs=[whole, whole, whole, whole, rows, rows],
        out_specs=(tile, tile, tile),
        compiler_params=_params(t, hd), interpret=interpret, name="flash_attention_bwd",
    )(q, k, v, do, lse, delta)


_flash.defvjp(_flash_fwd, _flash_bwd)
