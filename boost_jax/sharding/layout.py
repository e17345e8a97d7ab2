"""How one parameter-shaped array is stored: which dim is sharded over data-parallel axes,
its TP split, and zero padding when nothing divides (a leaf module: imports nothing of ours
but the mesh).

All roles (params, secondary, grads, opt_state) shard the *same* dim, with their axes in one
canonical order (axes held by more roles first; placement.order_axes), so a finer role's shard
is a sub-block of a coarser role's shard: moving between roles is a local slice one way and a
gather over the extra axes the other way. The dim is the largest one that divides by the
product of all role axes (never a scanned layer axis, never a TP-sharded dim unless nothing
else fits); if none divides, the largest dim is zero-padded at its end, like DeepSpeed's flat
buffers. Padding stays zero through training and is sliced off after each gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from boost_jax.mesh import axis_size


def spec_entry(axes: Sequence[str]):
    """One PartitionSpec entry for `axes` (None, a name, or a tuple, major first)."""
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes

@dataclass(frozen=True)
class LeafLayout:
    """How one parameter-shaped array is stored and sharded.

    shape: logical (model) shape; padded: stored shape (== shape unless `pad`);
    dim: the data-parallel sharded dim (None: replicated over every DP role);
    tp: per-dim model-parallel axes (() for none): TP axes, and the pipeline `stage` axis on
    dim 0 of a stage-split array (boost_jax/sharding/stages.py);
    layer_axis: dim 0 is a scanned layer axis (or the stage slots of a pipeline end weight);
    owner: a pipeline end weight stored as [stages, *leaf]: the slot holding the real leaf
    (the others are zeros);
    interleave: (stages, virtual) of a block stack split into interleaved virtual stages: its
    padded layers, logically [virtual, stages, k], are stored as [stages, virtual, k];
    after_stack: used once per pass after the layer stack (final norm, untied head): it can
    be fetched and reduced like a layer (Placement.in_backward, Engine.deferred_ends).
    """

    shape: tuple[int, ...]
    padded: tuple[int, ...]
    dim: Optional[int]
    tp: tuple[tuple[str, ...], ...]
    layer_axis: bool = False
    owner: Optional[int] = None
    interleave: Optional[tuple[int, int]] = None
    after_stack: bool = False

    @property
    def pad(self) -> int:
        return 0 if self.dim is None else self.padded[self.dim] - self.shape[self.dim]

    @property
    def numel(self) -> int:
        """Logical parameters (one slot of a pipeline end weight)."""
        return int(math.prod(self.shape[1:] if self.owner is not None else self.shape))

    @property
    def padded_numel(self) -> int:
        return int(math.prod(self.padded))

    def spec(self, axes: Sequence[str] = ()) -> P:
        """PartitionSpec with the TP axes plus `axes` (data-parallel) on `dim`."""
        entries = []
        for i, tp in enumerate(self.tp):
            ax = tuple(tp) + (tuple(axes) if i == self.dim else ())
            entries.append(spec_entry(ax))
        return P(*entries)

    def local_shape(self, mesh, axes: Sequence[str] = ()) -> tuple[int, ...]:
        """One device's block of the padded array: each dim split over its TP axes, and `dim`
        also over `axes` (`mesh`: a mesh or an {axis: size} dict)."""
        return tuple(s // axis_size(mesh, tp) // (axis_size(mesh, axes) if i == self.dim else 1)
                     for i, (s, tp) in enumerate(zip(self.padded, self.tp)))

    def sliced(self) -> "LeafLayout":
        """The layout of one layer of a stacked (scanned) array."""
        if not self.layer_axis:
            return self
        return LeafLayout(self.shape[1:], self.padded[1:],
                          None if self.dim is None else self.dim - 1, self.tp[1:], False)


def choose_layout(shape: Sequence[int], n: int, tp: Optional[Sequence] = None,
                  layer_axis: bool = False, mesh=None) -> LeafLayout:
    """Pick the dim sharded by n data-parallel devices (pad it if nothing divides).

    Preference: the largest non-TP dim that divides; then a TP dim whose local size divides
    (DP axes appended after the TP axes on that dim); then pad the largest non-TP dim. A
    layer axis is never chosen. Nothing eligible (e.g. a 1-D TP-sharded vector that does
    not divide): replicate over data-parallel axes (dim None, reported as overhead).
    """
    shape = tuple(int(s) for s in shape)
    tp = tuple(tuple(t or ()) if not isinstance(t, str) else (t,) for t in (tp or [()] * len(shape)))
    if len(tp) != len(shape):
        raise ValueError(f"tp spec {tp} does not match shape {shape}")
    if n <= 1 or not shape:
        return LeafLayout(shape, shape, None, tp, layer_axis)
    tp_size = [axis_size(mesh, t) if (t and mesh is not None) else 1 for t in tp]
    cands = [i for i in range(len(shape)) if not (layer_axis and i == 0)]
    free = [i for i in cands if not tp[i]]
    by_size = lambda dims: sorted(dims, key=lambda i: (-shape[i] // tp_size[i], i))  # noqa: E731
    for i in by_size(free):
        if shape[i] % n == 0:
            return LeafLayout(shape, shape, i, tp, layer_axis)
    for i in by_size([c for c in cands if tp[c]]):
        if (shape[i] // tp_size[i]) % n == 0:
            return LeafLayout(shape, shape, i, tp, layer_axis)
    if free:
        i = by_size(free)[0]
        padded = list(shape)
        padded[i] = -(-shape[i] // n) * n
        return LeafLayout(shape, tuple(padded), i, tp, layer_axis)
    return LeafLayout(shape, shape, None, tp, layer_axis)


def is_layout(x) -> bool:
    return isinstance(x, LeafLayout)


def pad(lay: LeafLayout, x):
    """Logical array → stored (zero-padded; a pipeline end weight into its owner's slot)."""
    if lay.owner is not None:
        x = x[None]
    widths = [(0, p - s) for s, p in zip(lay.shape[-x.ndim:], lay.padded[-x.ndim:])]
    if lay.owner is not None:
        widths[0] = (lay.owner, lay.padded[0] - lay.owner - 1)
    x = xp(x).pad(x, widths) if any(w != (0, 0) for w in widths) else x
    return interleave(x, *lay.interleave) if lay.interleave else x


def interleave(x, stages: int, virtual: int, inverse: bool = False):
    """Layer stack in model order [virtual·stages·k] ↔ stored order (stage s's chunks
    contiguous, so sharding dim 0 over `stage` gives stage s the layers of virtual stages
    s, s+P, …)."""
    src = (virtual, stages) if not inverse else (stages, virtual)
    x = x.reshape(*src, -1, *x.shape[1:])
    return xp(x).swapaxes(x, 0, 1).reshape(-1, *x.shape[3:])


def xp(x):
    """NumPy for host arrays (padded or unpadded without compiling a program), else jax.numpy."""
    return np if isinstance(x, np.ndarray) else jnp


def unpad(lay: LeafLayout, x):
    """Stored (padded) array → logical array."""
    if lay.interleave:
        x = interleave(x, *lay.interleave, inverse=True)
    if lay.owner is not None:
        x, shape = x[lay.owner], lay.shape[1:]
    else:
        shape = lay.shape
    if tuple(x.shape) == tuple(shape):
        return x
    return x[tuple(slice(0, s) for s in shape)]


def real_positions(lay: LeafLayout) -> list:
    """Per stored dim, a boolean vector of the indices that hold the logical array; the real
    elements of the stored array are their outer product (padding is at the end of a dim, the
    owner is one slot of dim 0, interleaving permutes dim 0: every case is separable)."""
    vecs = [np.arange(p) < s for s, p in zip(lay.shape, lay.padded)]
    if lay.owner is not None:
        vecs[0] = np.arange(lay.padded[0]) == lay.owner
    if lay.interleave:  # interleave's own reshapes, in numpy (a constant inside a jit)
        stages, virtual = lay.interleave
        vecs[0] = vecs[0].reshape(virtual, stages, -1).swapaxes(0, 1).reshape(-1)
    return vecs


def pad_tree(layouts, tree):
    return jax.tree.map(pad, layouts, tree, is_leaf=is_layout)


def unpad_tree(layouts, tree):
    return jax.tree.map(unpad, layouts, tree, is_leaf=is_layout)


__all__ = ["LeafLayout", "choose_layout", "spec_entry", "is_layout", "pad", "unpad", "interleave",
           "real_positions", "pad_tree", "unpad_tree"]
