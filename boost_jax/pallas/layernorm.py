"""Online-LayerNorm: LayerNorm(x)·A for a d-sharded x with ONE reduction (BTP, GPT families).

Math. x = [x_1|…|x_t] over t TP ranks (n = d/t columns each), γ, β likewise, A = [A_1; …; A_t]
by rows. With this rank's local mean m_i, centred sum of squares M2_i = Σ_j (x_ij − m_i)² and
local scale std_i = sqrt(M2_i/n + ε):

    x̂_i = (x_i − m_i)/std_i ⊙ γ_i          (local kernel; O(1), safe in bf16)
    u_i = std_i · (x̂_i A_i) = ((x_i − m_i) ⊙ γ_i) A_i
    g_i = γ_i A_i,  c_i = β_i A_i            (weights only, [r] each)

Chan's parallel combination gives the exact global statistics from per-rank ones:
    μ = mean_i m_i,   M2 = Σ_i M2_i + n Σ_i (m_i − μ)²,   var = M2/d
and  LayerNorm(x)·A = (Σ_i u_i + Σ_i (m_i − μ) g_i) / sqrt(var + ε) + Σ_i c_i.
Nothing is ever formed as a difference of large sums (no Σx² − dμ²), so it stays stable when
|mean| ≫ std. The all-reduce therefore carries, per token, [u_i | M2_i | m_i in slot i of t]
(r + 1 + t), and, once per call, the weights-only [g_i in slot i of t; c_i] ([t+1, r]): both
operands of one psum, which XLA combines into one all-reduce with the latent.

`local_layernorm` is the Pallas kernel of the local statistics (fwd and VJP);
`local_layernorm_ref` its XLA twin; `online_layernorm_matmul` the whole path.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from boost_jax.pallas.common import F32, local_norm, mm, norm_calls, norm_vjp, tile_masks
from boost_jax.pallas.rmsnorm import scaled_backward, scaled_ref


# ---------------------------------------------------------------- kernels
def _fwd_kernel(x_ref, g_ref, xh_ref, m_ref, q_ref, r_ref, *, T, d, eps, bt, bd):
    rm, cm, msk = tile_masks(T, d, bt, bd)
    x = plt.load(x_ref, mask=msk, other=0).astype(F32)
    g = plt.load(g_ref, mask=cm, other=0).astype(F32)
    m = jnp.sum(x, axis=1) / d
    c = jnp.where(msk, x - m[:, None], 0.0)
    q = jnp.sum(c * c, axis=1)
    std = jnp.sqrt(q / d + eps)
    plt.store(xh_ref, (c * (1.0 / std)[:, None] * g[None, :]).astype(xh_ref.dtype), mask=msk)
    plt.store(m_ref, m, mask=rm)
    plt.store(q_ref, q, mask=rm)
    plt.store(r_ref, std, mask=rm)


def _bwd_kernel(x_ref, g_ref, gxh_ref, gm_ref, gq_ref, gr_ref, dx_ref, dg_ref, *,
                T, d, eps, bt, bd):
    rm, cm, msk = tile_masks(T, d, bt, bd)
    x = plt.load(x_ref, mask=msk, other=0).astype(F32)
    g = plt.load(g_ref, mask=cm, other=0).astype(F32)
    gxh = plt.load(gxh_ref, mask=msk, other=0).astype(F32)
    gm, gq, gr = (plt.load(ref, mask=rm, other=0).astype(F32) for ref in (gm_ref, gq_ref, gr_ref))
    m = jnp.sum(x, axis=1) / d  # statistics recomputed: x is loaded anyway
    c = jnp.where(msk, x - m[:, None], 0.0)
    dc, dg = scaled_backward(c, g, gxh, gq, gr, d, eps)
    dx = dc - (jnp.sum(dc, axis=1) / d)[:, None] + (gm / d)[:, None]  # through the mean
    plt.store(dx_ref, dx.astype(dx_ref.dtype), mask=msk)
    plt.store(dg_ref, dg, mask=cm)


_norm_pallas = norm_vjp(*norm_calls(_fwd_kernel, _bwd_kernel, 3, "online_layernorm"))


# ---------------------------------------------------------------- local statistics
def local_layernorm(x, gamma, eps: float = 1e-5, *, interpret: bool = False):
    """Pallas: x [..., n], γ [n] → (x̂ [..., n] x.dtype, m, M2, std [...] fp32)."""
    return local_norm(_norm_pallas, x, gamma, eps, interpret)


def local_layernorm_ref(x, gamma, eps: float = 1e-5, *, interpret: bool = False):
    """XLA twin of `local_layernorm` (interpret unused)."""
    del interpret
    xf = x.astype(F32)
    m = jnp.mean(xf, axis=-1)
    xh, q, std = scaled_ref(xf - m[..., None], gamma, eps)
    return xh.astype(x.dtype), m, q, std


# ---------------------------------------------------------------- the whole path
def online_layernorm_partial(x, gamma, beta, a, rank, t: int, eps: float = 1e-5, *,
                             impl: str = "xla", interpret: bool = False, dtype=None):
    """This rank's (token payload [..., r+1+t] fp32, weights payload [t+1, r] fp32)."""
    fn = local_layernorm if impl == "pallas" else local_layernorm_ref
    xh, m, q, std = fn(x, gamma, eps, interpret=interpret)
    cdt = dtype or x.dtype
    u = std[..., None] * jnp.matmul(xh.astype(cdt), a.astype(cdt),
                                    preferred_element_type=F32).astype(F32)
    slot = (jnp.arange(t) == rank).astype(F32)  # this rank's column of the t slots
    token = jnp.concatenate([u, q[..., None], m[..., None] * slot], axis=-1)
    ga = mm(jnp.stack([gamma.astype(F32), beta.astype(F32)]), a.astype(F32))  # [2, r]
    weights = jnp.concatenate([slot[:, None] * ga[0], ga[1:]], axis=0)
    return token, weights


def online_layernorm_finish(token, weights, d: int, t: int, eps: float = 1e-5, out_dtype=None):
    """Reduced payloads → LayerNorm(x)·A [..., r] (Chan's combination; see module doc)."""
    r = weights.shape[-1]
    U, M2, means = token[..., :r], token[..., r], token[..., r + 1:]
    mu = jnp.mean(means, axis=-1, keepdims=True)
    dev = means - mu
    var = (M2 + (d // t) * jnp.sum(dev * dev, axis=-1)) / d
    num = U + jnp.einsum("...t,tr->...r", dev, weights[:t], precision=lax.Precision.HIGHEST)
    y = num * lax.rsqrt(var + eps)[..., None] + weights[t]
    return y.astype(out_dtype or F32)


def online_layernorm_matmul(x, gamma, beta, a, d: int, eps: float = 1e-5,
                            reduce_fn: Optional[Callable] = None, rank=0, t: int = 1, *,
                            impl: str = "xla", interpret: bool = False, out_dtype=None):
    """LayerNorm(x)·A for a d-sharded x [..., d/t] (this rank's γ, β [d/t], A rows [d/t, r]):
    reduce_fn sums the pair (token payload, weights payload) over the TP ranks in one
    collective (None: one device, t=1)."""
    pay = online_layernorm_partial(x, gamma, beta, a, rank, t, eps, impl=impl,
                                   interpret=interpret, dtype=out_dtype)
    token, weights = pay if reduce_fn is None else reduce_fn(pay)
    return online_layernorm_finish(token, weights, d, t, eps, out_dtype or x.dtype)
