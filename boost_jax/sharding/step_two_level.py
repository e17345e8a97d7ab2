"""The optimizer step's own collectives in two levels (parallel.collectives other than flat;
log_step's exchanges are for the layer loop, so rings here, Policy.rings):
the new weights' gathers between shardings and the clip's global norm, which step/build.py
otherwise leaves to XLA's partitioner (one flat group over every axis they span).

    update_gather   a leaf stored over axes `src` → over `dst`, where dst is a prefix of src:
                    a tiled all-gather over the rest of src on the leaf's dim (the shards of a
                    prefix are runs of the finer ones), as bucket.tiled_all_gather
    global_norm     one fp32 partial sum of squares per leaf (counted once: a leaf's copies
                    over the axes it is not sharded on add zero), all-reduced over every axis
                    in one call, as step_collectives lists "grad norm"

Both run in a small shard_map of their own (untyped: its results are replicated by
construction). Under `flat` step/build.py keeps its partitioner-placed collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from boost_jax.backends.cpu import reshard_bits
from boost_jax.sharding import bucket
from boost_jax.sharding.layout import is_layout


def _smap(mesh, body, in_specs, out_specs):
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def update_gather(pl, tree, src, dst):
    """Each leaf of `tree` (sharded over `src` on its layout's dim) → sharded over `dst`."""
    src, dst = tuple(src), tuple(dst)
    extra = src[len(dst):]

    def one(lay, x):
        if lay.dim is None or src == dst:
            return x
        if src[:len(dst)] != dst:  # not a prefix: the partitioner's reshard
            return reshard_bits(x, NamedSharding(pl.mesh, lay.spec(dst)),
                                NamedSharding(pl.mesh, lay.spec(src)))
        body = lambda v: bucket.tiled_all_gather(  # noqa: E731
            v, extra, lay.dim, pl.step_policy)
        return _smap(pl.mesh, body, lay.spec(src), lay.spec(dst))(x)

    return jax.tree.map(one, pl.layouts, tree, is_leaf=is_layout)


def every_axis(pl) -> tuple[str, ...]:
    """The mesh axes of more than one device: the grad norm's all-reduce group."""
    return tuple(a for a, n in pl.mesh.shape.items() if int(n) > 1)


def global_norm(pl, grads, axes):
    """‖grads‖₂ for grads sharded over `axes` (each leaf on its layout's dim)."""
    lays, tree = jax.tree.flatten(pl.layouts, is_leaf=is_layout)
    leaves = tree.flatten_up_to(grads)
    specs = [lay.spec(axes) for lay in lays]
    every = every_axis(pl)

    def body(*xs):
        parts = []
        for lay, spec, x in zip(lays, specs, xs):
            held = {a for e in spec if e is not None
                    for a in ((e,) if isinstance(e, str) else e)}
            first = jnp.array(True)
            for a in every:  # one copy of a leaf replicated over `a` counts
                if a not in held:
                    first &= jax.lax.axis_index(a) == 0
            parts.append(jnp.where(first, jnp.sum(jnp.square(x.astype(jnp.float32))), 0.0))
        sums = bucket.all_reduce(jnp.stack(parts), every, pl.step_policy)
        return jnp.sqrt(jnp.sum(sums))

    return _smap(pl.mesh, body, tuple(specs), jax.sharding.PartitionSpec())(*leaves)


__all__ = ["update_gather", "global_norm", "every_axis"]
