"""TPOps: the part of forward.Ops every tensor-parallel layout (megatron, vanilla, btp)
inherits — fetch, the embedding and the head (head.py), LaX's first latents. Each layout's
subclass adds project_in / project_out."""

from __future__ import annotations

from typing import Callable, Optional

from boost_jax.layers.forward import first_latents
from boost_jax.sharding.tp import head
from boost_jax.sharding.tp.common import TPContext


class TPOps:
    """The part of forward.Ops common to every TP layout (see the module docstring)."""

    def __init__(self, ctx: TPContext, fetch: Optional[Callable] = None):
        self.ctx = ctx
        self._fetch = fetch

    def fetch(self, stored, slots, path):
        return stored if self._fetch is None else self._fetch(stored, slots, path)

    def init_prev(self, tokens):
        """LaX: the first block crosses with zeros (replicated, like every TP latent)."""
        if not self.ctx.lax:
            return None
        return first_latents(tokens, self.ctx.r, self.ctx.dtype, self.ctx.latent_keys)

    def embed(self, table, tokens):
        return head.embed(self.ctx, table, tokens)

    def head_loss(self, h, norm, w, targets):
        return head.head_loss(self.ctx, h, norm, w, targets)
