"""Online-RMSNorm: the local (per-TP-shard) part, as a Pallas kernel and an XLA reference.

Math. The hidden dim d is split over t TP ranks: x = [x_1|…|x_t], x_i ∈ R^{T×d_i}, γ likewise,
and the down-projection A (d×r) by rows: A = [A_1; …; A_t]. Exact RMSNorm then projection:

    y = (x ⊙ γ / rms(x)) A,            rms(x) = sqrt(S/d + ε),  S = Σ_i s_i,  s_i = Σ_j x_ij²

rms(x) is one scalar per token and A is linear, so with the *local* statistics
    rms_i = sqrt(s_i/d_i + ε),  x̂_i = (x_i / rms_i) ⊙ γ_i,  u_i = rms_i · (x̂_i A_i) = (x_i⊙γ_i) A_i
we get
    y = U / sqrt(S/d + ε),  U = Σ_i u_i.
Each rank reduces the payload [u_i | s_i] (s_i appended as one extra column) in ONE collective,
then scales. Normalising locally before the GEMM keeps x̂_i O(1) in bf16 (BOOST does this);
multiplying rms_i back after the GEMM (in fp32) makes the sum exact: ε cancels in rms_i·x̂_i.

`local_rmsnorm` returns (x̂_i [T,d_i] in x.dtype, s_i [T] fp32, rms_i [T] fp32).
`online_rmsnorm_matmul` is the full local-normalise → GEMM → reduce → scale path; the BTP layer
calls it with `reduce_fn=lambda p: jax.lax.psum(p, tp_axes)` and it knows nothing of meshes.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from boost_jax.pallas.common import F32, local_norm, norm_calls, norm_vjp, tile_masks
from boost_jax.pallas.grouped import norm_matmul, xla_mm


# ---------------------------------------------------------------- forward kernel
def _fwd_kernel(x_ref, g_ref, xh_ref, s_ref, r_ref, *, T, d, eps, bt, bd):
    rm, cm, m = tile_masks(T, d, bt, bd)
    x = plt.load(x_ref, mask=m, other=0).astype(F32)
    g = plt.load(g_ref, mask=cm, other=0).astype(F32)
    s = jnp.sum(x * x, axis=1)
    rms = jnp.sqrt(s / d + eps)
    xh = x * (1.0 / rms)[:, None] * g[None, :]
    plt.store(xh_ref, xh.astype(xh_ref.dtype), mask=m)
    plt.store(s_ref, s, mask=rm)
    plt.store(r_ref, rms, mask=rm)


# ---------------------------------------------------------------- backward kernel
def _bwd_kernel(x_ref, g_ref, gxh_ref, gs_ref, gr_ref, dx_ref, dg_ref, *, T, d, eps, bt, bd):
    rm, cm, m = tile_masks(T, d, bt, bd)
    x = plt.load(x_ref, mask=m, other=0).astype(F32)
    g = plt.load(g_ref, mask=cm, other=0).astype(F32)
    gxh = plt.load(gxh_ref, mask=m, other=0).astype(F32)
    gs = plt.load(gs_ref, mask=rm, other=0).astype(F32)
    gr = plt.load(gr_ref, mask=rm, other=0).astype(F32)
    dx, dg = scaled_backward(x, g, gxh, gs, gr, d, eps)
    plt.store(dx_ref, dx.astype(dx_ref.dtype), mask=m)
    plt.store(dg_ref, dg, mask=cm)  # per-block partial


def scaled_backward(c, g, gxh, gq, gr, d: int, eps: float):
    """The tile's VJP of x̂ = c / σ ⊙ γ, q = Σ c², σ = sqrt(q/d + ε) per row, given the
    cotangents of x̂, q and σ: (dc, this tile's part of dγ). RMSNorm's c is x itself;
    LayerNorm's is x − mean (its kernel adds the mean's own path)."""
    inv = 1.0 / jnp.sqrt(jnp.sum(c * c, axis=1) / d + eps)  # recomputed: c is loaded anyway
    gy = gxh * g[None, :]  # cotangent of c / σ
    # total d/dq: direct gq plus the path through σ (dσ/dq = 1/(2dσ))
    gq_tot = gq + (gr - jnp.sum(gy * c, axis=1) * inv * inv) * inv / (2.0 * d)
    dc = gy * inv[:, None] + 2.0 * c * gq_tot[:, None]
    return dc, jnp.sum(gxh * c * inv[:, None], axis=0)


_norm_pallas = norm_vjp(*norm_calls(_fwd_kernel, _bwd_kernel, 2, "online_rmsnorm"))


# ---------------------------------------------------------------- public API
def local_rmsnorm(x, gamma, eps: float = 1e-6, *, interpret: bool = False):
    """Pallas: x [..., d_i], γ [d_i] -> (x̂ [..., d_i] x.dtype, s [...] fp32, rms [...] fp32)."""
    return local_norm(_norm_pallas, x, gamma, eps, interpret)


def local_rmsnorm_ref(x, gamma, eps: float = 1e-6, *, interpret: bool = False):
    """XLA reference with the same signature and math as `local_rmsnorm` (interpret unused)."""
    del interpret
    xh, s, rms = scaled_ref(x.astype(F32), gamma, eps)
    return xh.astype(x.dtype), s, rms


def scaled_ref(c, gamma, eps: float):
    """XLA: (c / σ ⊙ γ, q, σ) with q = Σ c², σ = sqrt(q/n + ε) over the last axis (fp32)."""
    q = jnp.sum(c * c, axis=-1)
    sigma = jnp.sqrt(q / c.shape[-1] + eps)
    return c * (1.0 / sigma)[..., None] * gamma.astype(F32), q, sigma


def norm_matmul_ref(x, gamma, a, *, out_dtype=None, eps: float = 1e-6, interpret: bool = False):
    """XLA payload [..., r+1] = [rms_i·(x̂_i @ A_i) | s_i] for x [..., d_i], A [d_i, r]: the
    twin of grouped.norm_matmul, same signature (and, as it, over x's rows)."""
    del interpret
    lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
    xh, s, rms = local_rmsnorm_ref(x, gamma, eps)
    cdt = jnp.promote_types(x.dtype, a.dtype)
    u = rms[:, None] * xla_mm(xh.astype(cdt), a.astype(cdt))
    p = jnp.concatenate([u, s[:, None]], axis=-1).astype(out_dtype or x.dtype)
    return p.reshape(*lead, p.shape[-1])


def online_rmsnorm_finish(reduced, d_global: int, eps: float = 1e-6, out_dtype=None):
    """[U | S] (reduced over TP, [..., r+1]) -> y = U / sqrt(S/d + ε), [..., r]."""
    U = reduced[..., :-1].astype(F32)
    S = reduced[..., -1].astype(F32)
    y = U * lax.rsqrt(S / d_global + eps)[..., None]
    return y.astype(out_dtype or reduced.dtype)


def online_rmsnorm_partial(x_local, gamma_local, a_local, eps: float = 1e-6, *,
                           impl: str = "xla", interpret: bool = False, comm_dtype=None):
    """This shard's payload [..., r+1] = [u_i | s_i] in comm_dtype (default x.dtype)."""
    cd = comm_dtype or x_local.dtype
    if impl == "pallas":
        return norm_matmul(x_local, gamma_local, a_local, out_dtype=cd, interpret=interpret)
    if impl == "xla":
        return norm_matmul_ref(x_local, gamma_local, a_local, out_dtype=cd, eps=eps)
    raise ValueError(f"impl must be 'pallas' or 'xla', got {impl!r}")


def online_rmsnorm_matmul(x_local, gamma_local, a_local, d_global: int, eps: float = 1e-6,
                          reduce_fn: Optional[Callable] = None, *, impl: str = "xla",
                          interpret: bool = False, comm_dtype=None, out_dtype=None):
    """RMSNorm(x)·γ @ A for a d-sharded x, with ONE reduction carrying [U | S].

    x_local [..., d_i], gamma_local [d_i], a_local [d_i, r] (this rank's rows of A, e.g. the
    concatenated A_q|A_k|A_v); d_global = full hidden size d. reduce_fn sums the payload
    [..., r+1] over the TP ranks (e.g. `lambda p: jax.lax.psum(p, axes)`); None = one device.
    comm_dtype: payload dtype on the wire (default x.dtype; S then travels in bf16 too, which
    costs ≤2^-9 relative in the scale — below bf16 output rounding). Returns [..., r] in
    out_dtype (default x.dtype). impl='pallas' uses the fused kernel (grouped.norm_matmul).
    """
    p = online_rmsnorm_partial(x_local, gamma_local, a_local, eps, impl=impl,
                               interpret=interpret, comm_dtype=comm_dtype)
    red = p if reduce_fn is None else reduce_fn(p)
    return online_rmsnorm_finish(red, d_global, eps, out_dtype or x_local.dtype)
