"""Restoring a checkpoint saved with another pipeline split (stages P, virtual stages V).

A checkpoint holds the stored state (boost_jax/sharding/stages.py): with P > 1 stages the end
weights (embedding, final norm, head, and their optimizer moments) are stacked as
[P, *leaf] with the real leaf in their owner's slot, and the block arrays are zero-padded to
P·V·ceil(L/(P·V)) layers, stored interleaved when V > 1. Orbax's non-strict restore already
pads or truncates zeros at the end of each dim (other plans, meshes, layer padding); the end
weights move between slots here: they are read in their saved shape (replicated: they are a
small part of the model, and this happens once per resume), their leaf taken from the saved
owner's slot, fitted to the new padding and put into the new owner's slot. When either split
interleaves (V > 1) and the splits differ, the block arrays are read the same way (the whole
stack on every device, once per resume), put back into model order, fitted and re-interleaved.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.backends.cpu import dev_compile_options
from boost_jax.layers.forward import path_keys
from boost_jax.sharding.layout import interleave
from boost_jax.sharding.stages import ENDS, owner


def saved_stages(meta: Optional[dict]) -> tuple[int, int]:
    """(stages, virtual stages) of the run that wrote a checkpoint ((1, 1) before stages)."""
    par = ((meta or {}).get("config") or {}).get("parallel") or {}
    return int(par.get("pp_stages", 1) or 1), int(par.get("pp_virtual", 1) or 1)


def _blocks_move(path, old: tuple, new: tuple) -> bool:
    """A block-stack leaf whose layer order differs between the two splits."""
    return (old[1] > 1 or new[1] > 1) and "blocks" in path_keys(path)


def end_of(path) -> Optional[str]:
    """The end weight (embed, final_norm, lm_head) a state leaf belongs to, if any."""
    return next((key for key in path_keys(path) if key in ENDS), None)


def _replicated(sds):
    sh = getattr(sds, "sharding", None)
    if isinstance(sh, NamedSharding):
        return NamedSharding(sh.mesh, P())
    return sh


def _key(path) -> tuple:
    return tuple(map(str, path_keys(path)))


def shapes_by_path(tree: Any) -> dict:
    """{normalised key path: shape} of a tree of arrays or array metadata (orbax writes
    optax's named tuples as dicts: paths are compared by their key names)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {_key(p): tuple(x.shape) for p, x in flat if x is not None}


def saved_shapes(step_dir: str) -> dict:
    """{key path: shape} of a checkpoint step's state arrays (its metadata; nothing read)."""
    import orbax.checkpoint as ocp
    from etils import epath

    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(step_dir) / "state")
    return shapes_by_path(getattr(tree, "tree", tree))


def restore_target(abstract_state: Any, saved: dict, old: tuple, new: tuple) -> Any:
    """The abstract state to read: end leaves in their saved shape (`saved` from
    shapes_by_path of the checkpoint's metadata), replicated."""
    if old == new:
        return abstract_state

    def one(path, sds):
        if end_of(path) is None and not _blocks_move(path, old, new):
            return sds
        return jax.ShapeDtypeStruct(saved[_key(path)], sds.dtype, sharding=_replicated(sds))

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def fit(x, shape):
    """Zero-pad or truncate every dim at its end (what a non-strict restore does)."""
    x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, shape))]
    widths = [(0, b - a) for a, b in zip(x.shape, shape)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def convert(restored: Any, abstract_state: Any, old: tuple, new: tuple) -> Any:
    """The restored state (end leaves in their saved shape) → the stored form of `new` stages."""
    if old == new:
        return restored

    def one(path, x, sds):
        if tuple(x.shape) == tuple(sds.shape) == (1,):
            return x  # a placeholder (Adafactor's for an unfactored weight): nothing to move
        end = end_of(path)
        if end is None:
            if not _blocks_move(path, old, new):
                return x
            x = interleave(x, *old, inverse=True) if old[1] > 1 else x
            x = fit(x, sds.shape).astype(sds.dtype)
            return interleave(x, *new) if new[1] > 1 else x
        leaf = x[owner(end, old[0])] if old[0] > 1 else x
        if new[0] == 1:
            return fit(leaf, sds.shape)
        stacked = jnp.zeros(sds.shape, sds.dtype)
        return stacked.at[owner(end, new[0])].set(fit(leaf, sds.shape[1:]).astype(sds.dtype))

    shardings = jax.tree.map(lambda s: getattr(s, "sharding", None), abstract_state)
    fn = jax.jit(lambda t: jax.tree_util.tree_map_with_path(one, t, abstract_state),
                 out_shardings=shardings, compiler_options=dev_compile_options())
    return fn(restored)


__all__ = ["saved_stages", "end_of", "shapes_by_path", "saved_shapes", "restore_target", "fit", "convert"]
