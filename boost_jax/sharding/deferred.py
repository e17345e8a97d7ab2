"""A deferred update: the new weights' gather to the params sharding moved from after the
optimizer into the next step's first forward, layer by layer.

With parallel.defer_update (Placement.defer_update) the step stores the updated working
weights cast on their opt_state shard (step/build.py), and the first micro-batch fetches each
layer from there: gathers over opt_state − grads axes (across nodes: the node's shard only),
then grads − params axes (inside the node), to the params shard (Placement.update_stages),
then as every micro-batch does (secondary, gather over the params axes). XLA pipelines these
gathers behind the previous layer's compute, as it does a ZeRO-3 layer's.

The params shards are named for remat to keep (the backward never gathers across nodes
again) and leave the layer loop as the cotangent of a `capture` slot — zeros shaped like
them, `deferred_layers(capture=True)` — so the step's other micro-batches start from them
(step/engine.py: Engine.first_micro_batch). The final norm and an untied head, used once
after the layer loop, are fetched the same way where the forward uses them (Engine.deferred_ends),
so their gathers hide behind the layers'; the embedding, needed first, is gathered once at the
start of the step (Engine.ends_to_params).
"""

from __future__ import annotations

from typing import Callable

from boost_jax.sharding.gather import Deferred, paired, unpaired


def deferred_layers(checkpoint: Callable, capture: bool) -> Callable:
    """The per-layer wrapper of a deferred update's first micro-batch (the plan's remat
    `checkpoint` around it): layer(weights, h, prev) is called with the stored shards in
    `weights` wrapped in Deferred; with `capture` their slots are {"grads", "params"} and the
    cotangent of "params" is the layer's params shards."""

    def wrap(layer):
        def first(weights, h, prev):
            lp, ls = unpaired(weights)
            if capture:
                return layer(paired(Deferred(lp, ls["params"]), ls["grads"]), h, prev)
            return layer(paired(Deferred(lp), ls), h, prev)

        return checkpoint(first)

    return wrap


__all__ = ["deferred_layers"]
