"""SwiGLU MLP: down(silu(gate(x)) * up(x)); each projection a LowRankLinear of the arch."""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from boost_jax.layers.linear import LowRankLinear

MLP_PROJ = ("gate", "up", "down")


class MLP(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        mk = lambda i, o: LowRankLinear.from_config(cfg, i, o, rngs=rngs)  # noqa: E731
        self.gate = mk(cfg.d_model, cfg.d_ff)
        self.up = mk(cfg.d_model, cfg.d_ff)
        self.down = mk(cfg.d_ff, cfg.d_model)

    def __call__(self, x: jax.Array, prev: Optional[dict] = None):
        """x [b, s, d] (already normed) → (out [b, s, d], {gate,up,down: latent or None})."""
        prev = prev or {}
        g, zg = self.gate(x, prev.get("gate"))
        u, zu = self.up(x, prev.get("up"))
        out, zd = self.down(jax.nn.silu(g) * u, prev.get("down"))
        return out, {"gate": zg, "up": zu, "down": zd}
