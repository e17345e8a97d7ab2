"""One linear-layer family for every architecture: full, svd, cola, lax.

    full: y = x @ w                                     params w [d_in, d_out]
    svd:  z = x @ a;                      y = z @ b       params a [d_in, r], b [r, d_out]
    cola: z = x @ a;                      y = silu(z) @ b
    lax:  z = Norm_r(x @ a + G(z_prev));  y = silu(z) @ b  + latent_scale [r] (+ g [r, r])

Any kind may carry `bias` [d_out] (the GPT families), added to y by the forward
(layers/forward.py: with_bias), after whatever collective produced y.

G is the identity (lax_gate="identity") or z_prev @ g (lax_gate="gate"; g starts as the
identity matrix, so both variants start as the identity crossing). z_prev is the latent of the
same projection in the previous block; None (first block) means zeros.

The math lives in pure functions on plain arrays so tensor-parallel code can reuse the pieces
on sharded weights inside shard_map (down-projection, [collective], finish_latent, up-projection).
`lowrank_apply` composes them for the unsharded case; `LowRankLinear` only holds the params.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.layers.norms import rms_norm
from boost_jax.names import ARCHS, LATENT_NAME

KINDS = ARCHS  # the projection kind is the model's arch



@jax.custom_vjp
def logits_matmul(x, w):
    """x [..., d] @ w [d, V] -> fp32 logits: the GEMM in x's (compute) dtype with fp32
    accumulation. Its backward rounds the fp32 cotangent to x's dtype once, so both backward
    GEMMs run in the compute dtype too (plain autodiff runs them in fp32: on an H200 they took
    13 of a CoLA-1B step's 58 ms, benchmarks/README.md §7); dw comes back in w's dtype."""
    return jnp.einsum("...d,dv->...v", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _logits_fwd(x, w):
    return logits_matmul(x, w), (x, w)


def _logits_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("...v,dv->...d", g, w.astype(x.dtype), preferred_element_type=jnp.float32)
    # one contracting dim: XLA:CPU runs no bf16 x bf16 = f32 dot over several
    dw = jnp.einsum("td,tv->dv", x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]),
                    preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


logits_matmul.defvjp(_logits_fwd, _logits_bwd)

def lowrank_init_std(d_in: int, d_out: int, r: int) -> float:
    """CoLA init scale for both factors: r^-1/4 · (d_in + d_out)^-1/4."""
    return r ** -0.25 * (d_in + d_out) ** -0.25


def matmul(x: jax.Array, w: jax.Array, dtype=None) -> jax.Array:
    """x @ w with both operands cast to the compute dtype (params may be stored wider)."""
    dtype = dtype or x.dtype
    return jnp.matmul(x.astype(dtype), w.astype(dtype))


def lax_cross(z: jax.Array, prev: Optional[jax.Array], params: dict, eps: float = 1e-6
              ) -> jax.Array:
    """Norm_r(z + G(prev)): the add and the norm in fp32, result in z.dtype."""
    zf = z.astype(jnp.float32)
    if prev is not None:
        g = params.get("g")
        cross = prev if g is None else matmul(prev, g, z.dtype)
        zf = zf + cross.astype(jnp.float32)
    return rms_norm(zf, params["latent_scale"], eps, z.dtype)


def finish_latent(kind: str, z: jax.Array, prev: Optional[jax.Array], params: dict,
                  eps: float = 1e-6) -> jax.Array:
    """The (fully reduced) down-projection z → the latent that is saved and carried.

    lax applies the crossing; every low-rank kind tags the result for remat="lowrank".
    """
    if kind == "lax":
        z = lax_cross(z, prev, params, eps)
    return checkpoint_name(z, LATENT_NAME)


def latent_activation(kind: str, z: jax.Array) -> jax.Array:
    """σ between the factors: identity for svd, SiLU for cola and lax."""
    return z if kind == "svd" else jax.nn.silu(z)


def lowrank_apply(kind: str, params: dict, x: jax.Array, prev: Optional[jax.Array] = None,
                  *, eps: float = 1e-6, dtype=None) -> tuple[jax.Array, Optional[jax.Array]]:
    """Apply one layer of `kind` to x [..., d_in] → (y [..., d_out], latent [..., r] or None)."""
    if kind not in KINDS:
        raise ValueError(f"unknown linear kind {kind!r}; expected one of {KINDS}")
    dtype = dtype or x.dtype
    if kind == "full":
        return matmul(x, params["w"], dtype), None
    z = finish_latent(kind, matmul(x, params["a"], dtype), prev, params, eps)
    y = matmul(latent_activation(kind, z), params["b"], dtype)
    return y, z


class LowRankLinear(nnx.Module):
    """Params as named in the module docstring; __call__(x, prev=None) -> (y, latent)."""

    def __init__(self, d_in: int, d_out: int, kind: str, *, rank: Optional[int] = None,
                 lax_gate: str = "identity", eps: float = 1e-6, init_std: float = 0.02,
                 param_dtype=jnp.float32, dtype=jnp.float32, bias: bool = False,
                 rngs: nnx.Rngs):
        if kind not in KINDS:
            raise ValueError(f"unknown linear kind {kind!r}; expected one of {KINDS}")
        self.kind, self.eps, self.dtype = kind, eps, jnp.dtype(dtype)
        param_dtype = jnp.dtype(param_dtype)
        if bias:
            self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype))
        if kind == "full":
            init = jax.nn.initializers.normal(init_std)
            self.w = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))
            return
        if not rank:
            raise ValueError(f"kind={kind} needs a rank")
        init = jax.nn.initializers.normal(lowrank_init_std(d_in, d_out, rank))
        self.a = nnx.Param(init(rngs.params(), (d_in, rank), param_dtype))
        self.b = nnx.Param(init(rngs.params(), (rank, d_out), param_dtype))
        if kind == "lax":
            self.latent_scale = nnx.Param(jnp.ones((rank,), param_dtype))
            if lax_gate == "gate":
                self.g = nnx.Param(jnp.eye(rank, dtype=param_dtype))
            elif lax_gate != "identity":
                raise ValueError(f"lax_gate={lax_gate!r}; expected 'identity' or 'gate'")

    @classmethod
    def from_config(cls, cfg, d_in: int, d_out: int, *, rngs: nnx.Rngs) -> "LowRankLinear":
        return cls(d_in, d_out, cfg.arch, rank=cfg.r, lax_gate=cfg.lax_gate, eps=cfg.norm_eps,
                   init_std=cfg.init_std, param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                   bias=cfg.bias, rngs=rngs)

    def params_dict(self) -> dict:
        names = ("w", "a", "b", "latent_scale", "g", "bias")
        return {n: getattr(self, n)[...] for n in names if hasattr(self, n)}

    def __call__(self, x: jax.Array, prev: Optional[jax.Array] = None):
        p = self.params_dict()
        y, z = lowrank_apply(self.kind, p, x, prev, eps=self.eps, dtype=self.dtype)
        return (y + p["bias"].astype(y.dtype) if "bias" in p else y), z
