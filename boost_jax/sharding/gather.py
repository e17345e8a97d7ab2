"""Per-layer weight fetch inside the manual step: ZeRO-3 gather, hpZ secondary, int8 (qwZ), and
the gradient's reduce-scatter into the grads sharding.

Runs inside the step's shard_map, manual over every mesh axis: x is this device's stored shard
(padded, TP-local, split over the params axes P on `layout.dim`). Forward, by plan (S =
secondary axes):

    no secondary   full = AG_P(x)                            backward re-gathers AG_P(x)
    secondary S    sec  = to_S(x)   [saved, SECONDARY_NAME]  backward re-gathers AG_S(sec)
                   full = AG_S(sec)
        to_S(x): S ⊇ P: a local slice of x (the axes' canonical order makes one role's shard a
        block of the next, placement.order_axes); otherwise (ZeRO++'s hpZ, S ⊂ P) a slice of
        the forward's flat gather AG_P(x), as DeepSpeed takes it.
    int8           each shard is quantized locally (blocks along a dim other than the sharded
                   one, so no block straddles a shard), q and its scales packed into one
                   buffer and gathered in one call, then dequantized: every gather under qwZ
                   (quantize_gather), AG_S of an int8 secondary.

The backward re-gather falls out of remat: each layer runs under jax.checkpoint with a policy
that saves SECONDARY_NAME and never the gathered weight (layers/remat.py).

Gradient: `fetch_leaf(f, x, slot)` is a custom_vjp whose primal ignores `slot` (zeros shaped
like this device's accumulator shard, Placement.accum_axes) and whose backward turns the full
weight's cotangent — this device's rows only — into the slot's cotangent: cast to
grad_accum_dtype, zero-pad, then reduce-scatter over the grads axes G on `layout.dim` (an
all-reduce over G for a leaf that is not sharded). The step differentiates with respect to the
slots, so each micro-batch's gradient lands in the grads sharding, reduced in grad_accum_dtype,
with one collective per weight written here. The full weight is marked varying over the batch
axes so that JAX does not insert its own reduction of the cotangent over them: what G leaves
out (the deferred axes R) stays unreduced until the end of the step — or, for the layer stack
with one micro-batch (Placement.in_backward), is reduced right here after G (`late_steps`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.backends.cpu import all_gather_bits
from boost_jax.names import SECONDARY_NAME
from boost_jax.sharding import quant
from boost_jax.sharding.layout import LeafLayout, unpad



def varying_axes(x) -> frozenset:
    """Manual axes along which x may differ between devices (its vma type)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def to_varying(x, axes):
    """Type x as varying over `axes` (identity forward; JAX transposes it to a psum)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def all_gather(x, axes, dim: int):
    return all_gather_bits(x, tuple(axes), dim) if axes else x


@dataclass(frozen=True)
class LeafFetch:
    """Static description of one weight's fetch (hashable: a custom_vjp nondiff arg)."""

    layout: LeafLayout  # per-layer layout (the scanned layer axis sliced off)
    sizes: tuple  # ((axis, size), ...) of the mesh
    batch_axes: tuple[str, ...]
    params_axes: tuple[str, ...]
    grads_axes: tuple[str, ...]
    secondary_axes: Optional[tuple[str, ...]]
    quantize_gather: bool
    secondary_int8: bool
    block: int
    dtype: str  # working-weight dtype: what the gathers move (before int8)
    grad_dtype: str  # what the gradient is reduced and accumulated in
    quantize_grads: bool = False  # qgZ: int4 all-to-all reduce-scatter of the gradient
    late: tuple = ((), ())  # (AR, RS) axes of R reduced in the backward (Placement.in_backward)

    @classmethod
    def of(cls, pl, lay: LeafLayout) -> "LeafFetch":
        """The fetch of one leaf of a placement (per-layer layout of a stacked leaf)."""
        late = pl.deferred_reduction(lay) if pl.in_backward(lay) else ((), ())
        return cls(lay.sliced(), tuple((a, int(n)) for a, n in pl.mesh.shape.items()),
                   pl.batch_axes, pl.params_axes, pl.grads_axes, pl.secondary_axes,
                   pl.quantize_gather, pl.secondary_int8, pl.quant_block, pl.param_dtype,
                   pl.grad_accum_dtype, pl.quantize_grads, late)

    @functools.cached_property
    def _size(self) -> dict:  # (not a field: equality and hashing ignore it)
        return dict(self.sizes)

    def n(self, axes) -> int:
        if not axes:
            return 1
        size = self._size
        return int(math.prod([size[a] for a in axes]))

    @property
    def dim(self):
        return self.layout.dim

    @property
    def gathers(self) -> bool:
        return self.dim is not None and bool(self.params_axes)

    def local_shape(self, axes) -> list[int]:
        """This device's block of the (per-layer, padded) leaf when dim is split over `axes`."""
        lay = self.layout
        return [s // self.n(tp) // (self.n(axes) if i == lay.dim else 1)
                for i, (s, tp) in enumerate(zip(lay.padded, lay.tp))]

    def quant_axis(self, src_axes) -> int:
        """The dim int8 blocks run along in a shard over `src_axes`: its longest (the sharded
        dim counts with its shard length, so no block straddles a shard)."""
        shape = self.local_shape(src_axes)
        return max(range(len(shape)), key=lambda i: (shape[i], i != self.dim, -i))

    # ---------------------------------------------------------------- forward pieces
    def qblock(self, n: int) -> int:
        """Block length for a run of n elements: ≤ `block`, evenly split (no padding waste)."""
        return math.ceil(n / math.ceil(n / self.block))

    def quantize(self, x, src_axes):
        """This device's shard over `src_axes` → (q, scale), blocks along quant_axis."""
        qa = self.quant_axis(src_axes)
        return quant.quantize(x, self.qblock(x.shape[qa]), axis=qa)

    def gather(self, x, axes, src_axes):
        """AG over `axes` on the sharded dim of an array, or of a (q, scale) pair; x is this
        device's shard over `src_axes`."""
        if not isinstance(x, tuple):
            return all_gather(x, axes, self.dim)
        qa, dtype, d = self.quant_axis(src_axes), jnp.dtype(self.dtype), self.dim
        if not axes:  # an int8 copy kept whole (secondary over no axes): dequantize only
            return quant.dequantize(*x, self.local_shape(src_axes), dtype, axis=qa)
        buf = quant.pack(*x)  # q and scales in one gather (blocks and scales: the last dims)
        if qa == d:  # blocks within each shard: stack the shards, dequantize, merge
            q, s = quant.unpack(jax.lax.all_gather(buf, tuple(axes), axis=0))
            src = self.local_shape(src_axes)
            y = jnp.moveaxis(quant.dequantize(q, s, (q.shape[0], *src), dtype, axis=d + 1), 0, d)
            return y.reshape(*src[:d], q.shape[0] * src[d], *src[d + 1:])
        at = self.dim if self.dim < qa else self.dim - 1  # where dim sits once qa moved last
        q, s = quant.unpack(all_gather(buf, axes, at))
        shape = self.local_shape(())
        shape[self.dim] = q.shape[at]
        return quant.dequantize(q, s, shape, dtype, axis=qa)

    def maybe_quantize(self, x, int8: bool, src_axes):
        return self.quantize(x, src_axes) if int8 else x

    @property
    def secondary_from_flat(self) -> bool:
        """The secondary is sliced from a flat gather over the params axes (ZeRO++'s hpZ,
        S ⊂ P), not locally from the stored shard (S ⊇ P, P-major)."""
        P, S = self.params_axes, self.secondary_axes
        return S is not None and S[:len(P)] != P

    @property
    def int8_secondary(self) -> bool:
        return self.secondary_int8 or self.quantize_gather

    def to_secondary(self, x):
        """Stored shard → this device's block of the secondary partition (int8: (q, scale))."""
        P, S = self.params_axes, self.secondary_axes
        if not self.secondary_from_flat:  # S ⊇ P, P-major: a local slice
            extra = S[len(P):]
            if extra:
                k = x.shape[self.dim] // self.n(extra)
                x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(extra) * k, k, self.dim)
        else:  # S ⊂ P (ZeRO++): from the forward's flat gather over P, as DeepSpeed does
            full = self.gather(self.maybe_quantize(x, self.quantize_gather, P), P, P)
            k = full.shape[self.dim] // self.n(S)
            x = jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(S) * k, k, self.dim)
        return self.maybe_quantize(x.astype(self.dtype), self.int8_secondary, S)

    def expand(self, src):
        """The saved source (stored shard or secondary) → the full, unpadded working weight."""
        if not self.gathers:
            full = src
        elif self.secondary_axes is None:
            full = self.gather(self.maybe_quantize(src, self.quantize_gather, self.params_axes),
                               self.params_axes, self.params_axes)
        else:
            full = self.gather(src, self.secondary_axes, self.secondary_axes)
        full = unpad(self.layout, full.astype(self.dtype))
        return to_varying(full, self.batch_axes)

    # ---------------------------------------------------------------- backward
    def slot_axes(self) -> tuple[str, ...]:
        """Batch axes the gradient slot varies over (what is all-reduced is invariant)."""
        summed = set(self.late[0]) | (set(self.grads_axes) if self.dim is None else set())
        return tuple(a for a in self.batch_axes if a not in summed)

    def reduce(self, ct):
        """Cotangent of the full weight (this device's rows) → its grads shard, reduced over G
        (and over R into the opt_state shard when reduced in the backward)."""
        ct = ct.astype(self.grad_dtype)
        if self.layout.pad:
            widths = [(0, 0)] * ct.ndim
            widths[self.dim] = (0, self.layout.pad)
            ct = jnp.pad(ct, widths)
        for kind, axes in self.grad_steps() + self.late_steps():
            if kind == "all-to-all":
                ct = self.int4_reduce_scatter(ct, axes)
            elif kind == "reduce-scatter":
                ct = jax.lax.psum_scatter(ct, axes, scatter_dimension=self.dim, tiled=True)
            else:
                ct = jax.lax.psum(ct, axes)
        return to_varying(ct, self.slot_axes())

    def grad_steps(self) -> list[tuple[str, tuple[str, ...]]]:
        """(kind, axes) of each collective that reduces a micro-batch's gradient over G: qgZ's
        int4 all-to-all per stage, else one reduce-scatter (an all-reduce for a leaf that is
        not sharded)."""
        G = self.grads_axes
        if not G:
            return []
        if self.dim is None:
            return [("all-reduce", G)]
        if self.quantize_grads:
            return [("all-to-all", axes) for axes in qgz_stages(G)]
        return [("reduce-scatter", G)]

    def late_steps(self) -> list[tuple[str, tuple[str, ...]]]:
        """(kind, axes) of the reduction over R that runs in the backward (Placement.in_backward):
        AR over R − O, then RS over R ∩ O, as the once-per-step reduction would."""
        ar, rs = self.late
        return ([("all-reduce", ar)] if ar else []) + ([("reduce-scatter", rs)] if rs else [])

    def int4_reduce_scatter(self, ct, axes):
        """ZeRO++'s qgZ step over `axes`: split the sharded dim into one chunk per device,
        quantize each chunk to int4 blocks, all-to-all, dequantize and sum what arrives (fp32):
        the reduce-scatter of psum_scatter(tiled) at a quarter of fp32's bytes."""
        n, d = self.n(axes), self.dim
        x = jnp.moveaxis(ct, d, 0)
        shard = (x.shape[0] // n,) + x.shape[1:]  # chunk i: rows i·L/n … (i+1)·L/n of dim
        x = x.reshape(n, -1)
        m = x.shape[1]
        block = self.qblock(m) + self.qblock(m) % 2  # int4 packs two values a byte
        buf = quant.pack(*quant.quantize_int4(x, block))  # packed int4 and scales: one call
        q, s = quant.unpack(jax.lax.all_to_all(buf, axes, 0, 0, tiled=True), jnp.uint8)
        y = jnp.sum(quant.dequantize_int4(q, s, m), axis=0)
        return jnp.moveaxis(y.reshape(shard), 0, d).astype(ct.dtype)


def qgz_stages(G: tuple[str, ...]) -> list[tuple[str, ...]]:
    """qgZ reduces inside the node first, then across nodes: the grads axes split into the
    intra-node prefix and the rest (one stage if the canonical order does not allow it)."""
    inner = tuple(a for a in G if a != "global")
    if inner and len(inner) < len(G) and G[:len(inner)] == inner:
        return [inner, G[len(inner):]]
    return [G]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fetch(f: LeafFetch, src, slot):
    del slot
    return f.expand(src)


def _fetch_fwd(f, src, slot):
    return _fetch(f, src, slot), None


def _fetch_bwd(f, _, ct):
    return None, f.reduce(ct)


_fetch.defvjp(_fetch_fwd, _fetch_bwd)


def fetch_leaf(f: LeafFetch, x, slot=None):
    """The full working weight of one stored shard x; with a gradient slot, its gradient lands
    (reduced over the grads axes) in the slot's cotangent (see the module docstring)."""
    src = x
    if f.gathers and f.secondary_axes is not None:
        src = checkpoint_name(f.to_secondary(jax.lax.stop_gradient(x)), SECONDARY_NAME)
    if slot is None:
        return f.expand(src)
    return _fetch(f, src, slot)


def fetch_tree(fetches, stored, slots=None):
    """fetch_leaf over matching trees (slots None: forward only)."""
    is_f = lambda v: isinstance(v, LeafFetch)  # noqa: E731
    if slots is None:
        return jax.tree.map(lambda f, x: fetch_leaf(f, x), fetches, stored, is_leaf=is_f)
    return jax.tree.map(fetch_leaf, fetches, stored, slots, is_leaf=is_f)


def slot_like(f: LeafFetch, local_shape, tp_axes: tuple[str, ...], typed: bool = True):
    """Zeros shaped like this device's grads shard, typed (under check_vma) as the backward's
    result."""
    z = jnp.zeros(local_shape, jnp.dtype(f.grad_dtype))
    return to_varying(z, f.slot_axes() + tp_axes) if typed else z


__all__ = ["LeafFetch", "fetch_leaf", "fetch_tree", "slot_like", "to_varying", "varying_axes",
           "all_gather", "SECONDARY_NAME"]
