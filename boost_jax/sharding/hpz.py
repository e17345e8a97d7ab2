"""ZeRO++'s hpZ as DeepSpeed runs it: one weight gather per layer in the forward.

With a secondary partition S that is a proper prefix of the params axes P (the zeropp preset:
P = all, S = pair+node), each layer's forward gathers its weights over P once (int8 under qwZ)
and keeps this device's S-block of what arrived — the |P|/|S| shards it is made of, packed as
they arrived under qwZ, so nothing is quantized twice — as the secondary; the backward
re-gathers the layer from it over S (inside the node). That is DeepSpeed's
`ds_secondary_tensor`, taken from the forward's all-gather.

jax.checkpoint cannot express it: remat replays the forward from what it saved, so a forward
weight gathered over P would be gathered over P again in the backward. `hpz_layers` wraps the
layer instead in a custom_vjp whose forward runs the layer on the flat gather and saves the
layer's inputs and the secondaries, and whose backward re-runs the layer from the secondaries
(sharding/gather.py: HpzForward, HpzBackward) and differentiates it — what a
train.remat=full checkpoint replays, so the engine takes this path under train.remat=full
only (LeafFetch.hpz); the gradients reduce-scatter as every plan's (gather.reduce_all).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from boost_jax.sharding.gather import HpzBackward, HpzForward, paired, unpaired


def _eval_jaxpr(jaxpr, consts, *args):
    run = getattr(jax.core, "eval_jaxpr", None)
    if run is None:  # pragma: no cover - a JAX that keeps it private
        from jax._src.core import eval_jaxpr as run
    return run(jaxpr, consts, *args)


def _staged(fn, *args):
    """fn traced on `args` (arrays or shapes) → (call(consts, *args), consts): its closure
    (the layer's positions, ...) made explicit, so a custom_vjp can take it as arguments."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out_tree, jaxpr = jax.tree.structure(shape), closed.jaxpr

    def call(consts, *a):
        return jax.tree.unflatten(out_tree, _eval_jaxpr(jaxpr, consts, *jax.tree.leaves(a)))

    return call, list(closed.consts)


def _replayed(layer: Callable, record, saved, replay) -> Callable:
    """layer(weights, h, prev) -> (h, prev) as a custom_vjp (weights: the stored shards `lp`,
    paired with their slots `ls` in a training step): the forward runs it on record(lp) and
    keeps saved(record); the backward re-runs it on replay(lp, kept) and differentiates that
    with respect to the slots."""

    def forward(lp, ls, h, prev):
        rec = record(lp)
        return layer(paired(rec, ls), h, prev), saved(rec)

    def replayed(lp, kept, g, h, prev):
        return layer(paired(replay(lp, kept), g), h, prev)

    def wrapped(weights, h, prev):
        lp, ls = unpaired(weights)
        fwd_call, c_fwd = _staged(forward, lp, ls, h, prev)
        kept = jax.eval_shape(forward, lp, ls, h, prev)[1]
        bwd_call, c_bwd = _staged(replayed, lp, kept, ls, h, prev)

        @jax.custom_vjp
        def run(lp, ls, h, prev, c_fwd, c_bwd):
            return fwd_call(c_fwd, lp, ls, h, prev)[0]  # not differentiated: no replay

        def fwd(lp, ls, h, prev, c_fwd, c_bwd):
            out, kept = fwd_call(c_fwd, lp, ls, h, prev)
            return out, (lp, kept, ls, h, prev, c_bwd)

        def bwd(res, ct):
            lp, kept, ls, h, prev, c_bwd = res
            _, vjp = jax.vjp(lambda s, x, p: bwd_call(c_bwd, lp, kept, s, x, p), ls, h, prev)
            dg, dh, dprev = vjp(ct)
            return (jax.tree.map(jnp.zeros_like, lp), dg, dh, dprev, [None] * len(c_fwd),
                    [None] * len(c_bwd))

        run.defvjp(fwd, bwd)
        return run(lp, ls, h, prev, c_fwd, c_bwd)

    return wrapped


def hpz_layers(layer: Callable) -> Callable:
    """layer(weights, h, prev) -> (h, prev) → the same function with hpZ's forward (one
    flat gather, secondaries kept) and backward (re-gathered from the secondaries)."""
    return _replayed(layer, HpzForward, lambda rec: rec.secs,
                     lambda lp, secs: HpzBackward(lp, secs))


__all__ = ["hpz_layers"]
