"""MLP params: gate (SwiGLU only), up, down, each a LowRankLinear of the arch (the sub-layer itself is
boost_jax.layers.forward.mlp)."""

from __future__ import annotations

from flax import nnx

from boost_jax.layers.linear import LowRankLinear


class MLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        mk = lambda i, o: LowRankLinear.from_config(cfg, i, o, rngs=rngs)  # noqa: E731
        if cfg.swiglu:
            self.gate = mk(cfg.d_model, cfg.d_ff)
        self.up = mk(cfg.d_model, cfg.d_ff)
        self.down = mk(cfg.d_ff, cfg.d_model)
