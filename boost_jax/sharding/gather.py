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
        the forward's flat gather AG_P(x), as DeepSpeed takes it; S = ∅ under qwZ keeps that
        int8 gather as it arrived and dequantizes it at each use (keeps_int8_gather).
    int8           each shard is quantized locally (blocks along a dim other than the sharded
                   one, so no block straddles a shard), q and its scales packed into one
                   buffer and gathered in one call, then dequantized: every gather under qwZ
                   (quantize_gather), AG_S of an int8 secondary.

Every collective here is described as a bucket.Send and issued by bucket.run for the whole
fetch unit (fetch_tree: a layer, the embedding, the final norm, the head), the gradient's
steps round by round across the unit's weights: the unit's int4 all-to-alls of one step move
in one call, the rest one per weight for XLA's combiners to merge (sharding/bucket.py).

The backward re-gather falls out of remat: each layer runs under jax.checkpoint with a policy
that saves SECONDARY_NAME and never the gathered weight (layers/remat.py).

Gradient: the fetch is a custom_vjp whose primal ignores the slots (zeros shaped like this
device's accumulator shard, Placement.accum_axes) and whose backward turns each full weight's
cotangent — this device's rows only — into its slot's cotangent: cast to grad_accum_dtype,
zero-pad, then reduce-scatter over the grads axes G on `layout.dim` (an all-reduce over G for
a leaf that is not sharded). The step differentiates with respect to the slots, so each
micro-batch's gradient lands in the grads sharding, reduced in grad_accum_dtype. The full
weight is marked varying over the batch axes so that JAX does not insert its own reduction of
the cotangent over them: what G leaves out (the deferred axes R) stays unreduced until the
end of the step — or, for the layer stack with one micro-batch and no pipeline
(Placement.in_backward), is reduced right here after G (`late_steps`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.names import SECONDARY_NAME
from boost_jax.sharding import bucket, quant
from boost_jax.sharding.bucket import Send, merge_stacked
from boost_jax.sharding.layout import LeafLayout, unpad
from boost_jax.sharding.two_level import FLAT, Policy



def varying_axes(x) -> frozenset:
    """Manual axes along which x may differ between devices (its vma type)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def to_varying(x, axes):
    """Type x as varying over `axes` (identity forward; JAX transposes it to a psum)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


class Int8Copies:
    """Which saved weight copies are int8, asked the same way by the engine (a leaf's fetch),
    the byte formulas and the cost model (a placement): both carry secondary_axes,
    quantize_gather (qwZ) and secondary_int8."""

    @property
    def int8_secondary(self) -> bool:
        return self.secondary_int8 or self.quantize_gather

    @property
    def keeps_int8_gather(self) -> bool:
        """An int8 gather kept whole (qwZ, S = ∅): the packed shards as they arrived are the
        secondary, dequantized at each use — never dequantized and quantized again."""
        return self.secondary_axes == () and self.quantize_gather


@dataclass(frozen=True)
class LeafFetch(Int8Copies):
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
    collectives: Policy = FLAT  # flat or two-level (sharding/two_level.py)

    @classmethod
    def of(cls, pl, lay: LeafLayout) -> "LeafFetch":
        """The fetch of one leaf of a placement (per-layer layout of a stacked leaf)."""
        late = pl.deferred_reduction(lay) if pl.in_backward(lay) else ((), ())
        return cls(lay.sliced(), tuple((a, int(n)) for a, n in pl.mesh.shape.items()),
                   pl.batch_axes, pl.params_axes, pl.grads_axes, pl.secondary_axes,
                   pl.quantize_gather, pl.secondary_int8, pl.quant_block, pl.param_dtype,
                   pl.grad_accum_dtype, pl.quantize_grads, late, pl.collectives)

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
    def is_gathered(self) -> bool:
        """Stored sharded over the params axes, so gathered before each use."""
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

    @property
    def group(self) -> tuple:
        """What keeps this weight's buffers apart from others' in a bucket (bucket.py): the
        TP axes its shard varies over."""
        return tuple(sorted({a for tp in self.layout.tp for a in tp}))

    def gather(self, x, axes, src_axes):
        """AG over `axes` on the sharded dim of an array, or of a (q, scale) pair (x: this
        device's shard over `src_axes`), as a bucket.Send (a value when nothing moves)."""
        d = self.dim
        if not isinstance(x, tuple):
            if not axes:
                return x
            return Send("all-gather", tuple(axes), x, lambda s: merge_stacked(s, d), self.group)
        if not axes:  # an int8 copy kept whole (secondary over no axes): dequantize only
            qa = self.quant_axis(src_axes)
            return quant.dequantize(*x, self.local_shape(src_axes), jnp.dtype(self.dtype),
                                    axis=qa)
        # q and its scales in one buffer (blocks and scales: the last dims)
        return Send("all-gather", tuple(axes), quant.pack(*x), self.int8_finish(src_axes),
                    self.group)

    def int8_finish(self, src_axes):
        """What an int8 gather of shards over `src_axes` does with the stacked packed shards
        [n, *packed shard] that arrive: dequantize and merge them into the weight."""
        d, qa, dtype = self.dim, self.quant_axis(src_axes), jnp.dtype(self.dtype)
        src = self.local_shape(src_axes)

        def finish(stacked):
            if qa == d:  # blocks within each shard: dequantize the stack, then merge
                q, s = quant.unpack(stacked)
                return merge_stacked(quant.dequantize(q, s, (q.shape[0], *src), dtype,
                                                      axis=d + 1), d)
            at = d if d < qa else d - 1  # where dim sits once qa moved last
            q, s = quant.unpack(merge_stacked(stacked, at))
            shape = list(src)
            shape[d] = q.shape[at]
            return quant.dequantize(q, s, shape, dtype, axis=qa)

        return finish

    def maybe_quantize(self, x, int8: bool, src_axes):
        return self.quantize(x, src_axes) if int8 else x

    @property
    def secondary_from_flat(self) -> bool:
        """The secondary is sliced from a flat gather over the params axes (ZeRO++'s hpZ,
        S ⊂ P), not locally from the stored shard (S ⊇ P, P-major)."""
        P, S = self.params_axes, self.secondary_axes
        return S is not None and S[:len(P)] != P

    def secondary_source(self, x):
        """What the secondary is cut from: the stored shard (S ⊇ P, P-major), or (ZeRO++'s
        hpZ, S ⊂ P) the forward's flat gather over P, as DeepSpeed takes it."""
        if not self.secondary_from_flat:
            return x
        P = self.params_axes
        send = self.gather(self.maybe_quantize(x, self.quantize_gather, P), P, P)
        return dataclasses.replace(send, finish=lambda a: a) if self.keeps_int8_gather else send

    def to_secondary(self, source):
        """secondary_source's result → this device's block of the secondary (int8: (q, s),
        or the stacked packed shards of a kept int8 gather)."""
        if self.keeps_int8_gather:
            return source
        P, S = self.params_axes, self.secondary_axes
        extra = S if self.secondary_from_flat else S[len(P):]
        x = source
        if extra:
            k = x.shape[self.dim] // self.n(extra)
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(extra) * k, k, self.dim)
        return self.maybe_quantize(x.astype(self.dtype), self.int8_secondary, S)

    def expand(self, src):
        """The saved source (stored shard or secondary) → the gather of the full weight (a
        bucket.Send, or the value when nothing moves); `finish_expand` completes it."""
        if not self.is_gathered:
            return src
        if self.keeps_int8_gather:
            return self.int8_finish(self.params_axes)(src)
        if self.secondary_axes is None:
            P = self.params_axes
            return self.gather(self.maybe_quantize(src, self.quantize_gather, P), P, P)
        return self.gather(src, self.secondary_axes, self.secondary_axes)

    def finish_expand(self, full):
        """The gathered weight → the full, unpadded working weight, typed as the batch's."""
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
        return reduce_all([self], [ct])[0]

    def reduce_start(self, ct):
        """The cotangent in grad_dtype, zero-padded to the stored (padded) length."""
        ct = ct.astype(self.grad_dtype)
        if self.layout.pad:
            widths = [(0, 0)] * ct.ndim
            widths[self.dim] = (0, self.layout.pad)
            ct = jnp.pad(ct, widths)
        return ct

    def reduce_step(self, ct, kind: str, axes) -> Send:
        """One step of `steps()` as a bucket.Send."""
        axes = tuple(axes)
        if kind == "all-to-all":
            return self.int4_reduce_scatter(ct, axes)
        if kind == "all-reduce":
            return Send(kind, axes, ct, group=self.group)
        n, d = self.n(axes), self.dim  # chunk i: rows i·L/n … (i+1)·L/n of dim
        x = jnp.moveaxis(ct, d, 0)
        x = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        return Send(kind, axes, x, lambda y: jnp.moveaxis(y, 0, d), self.group)

    def reduce_end(self, ct):
        return to_varying(ct, self.slot_axes())

    def steps(self) -> list[tuple[str, tuple[str, ...]]]:
        """Every collective of a micro-batch's gradient, in order."""
        return self.grad_steps() + self.late_steps()

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

    def int4_reduce_scatter(self, ct, axes) -> Send:
        """ZeRO++'s qgZ step over `axes`: split the sharded dim into one chunk per device,
        quantize each chunk to int4 blocks, all-to-all, dequantize and sum what arrives (fp32):
        the reduce-scatter of psum_scatter(tiled) at a quarter of fp32's bytes."""
        n, d = self.n(axes), self.dim
        x = jnp.moveaxis(ct, d, 0)
        shard = (x.shape[0] // n,) + x.shape[1:]  # chunk i: rows i·L/n … (i+1)·L/n of dim
        x = x.reshape(n, -1)
        m = x.shape[1]
        block = self.qblock(m) + self.qblock(m) % 2  # int4 packs two values a byte

        def finish(arrived):
            q, s = quant.unpack(arrived, jnp.uint8)
            y = jnp.sum(quant.dequantize_int4(q, s, m), axis=0)
            return jnp.moveaxis(y.reshape(shard), 0, d).astype(ct.dtype)

        # packed int4 and scales: one buffer
        buf = quant.pack(*quant.quantize_int4(x, block))
        return Send("all-to-all", axes, buf, finish, self.group)


def qgz_stages(G: tuple[str, ...]) -> list[tuple[str, ...]]:
    """qgZ reduces inside the node first, then across nodes: the grads axes split into the
    intra-node prefix and the rest (one stage if the canonical order does not allow it)."""
    inner = tuple(a for a in G if a != "global")
    if inner and len(inner) < len(G) and G[:len(inner)] == inner:
        return [inner, G[len(inner):]]
    return [G]


def _run(fs, requests) -> list:
    """bucket.run under the fetch unit's collectives policy (one per placement)."""
    return bucket.run(requests, fs[0].collectives if fs else FLAT)


def expand_all(fs, srcs) -> list:
    """Each weight's saved source → its full working weight (bucket.run issues the gathers)."""
    return [f.finish_expand(v) for f, v in zip(fs, _run(
        fs, [f.expand(src) for f, src in zip(fs, srcs)]))]


def reduce_all(fs, cts) -> list:
    """Each weight's cotangent → its slot's: the weights' r-th reduction steps run together
    (bucket.run: one int4 all-to-all per bucket)."""
    cts = [f.reduce_start(ct) for f, ct in zip(fs, cts)]
    steps = [f.steps() for f in fs]
    for r in range(max(map(len, steps), default=0)):
        cts = _run(fs, [f.reduce_step(ct, *st[r]) if r < len(st) else ct
                          for f, ct, st in zip(fs, cts, steps)])
    return [f.reduce_end(ct) for f, ct in zip(fs, cts)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fetch(fs: tuple, srcs: tuple, slots: tuple):
    del slots
    return tuple(expand_all(fs, srcs))


def _fetch_fwd(fs, srcs, slots):
    return _fetch(fs, srcs, slots), None


def _fetch_bwd(fs, _, cts):
    return tuple(None for _ in fs), tuple(reduce_all(fs, cts))


_fetch.defvjp(_fetch_fwd, _fetch_bwd)


def secondaries(fs, xs) -> list:
    """The saved source of each weight: its stored shard, or its secondary block (cut from
    one bucketed flat gather under hpZ), named for remat to keep."""
    want = [f.is_gathered and f.secondary_axes is not None for f in fs]
    sources = _run(fs, [f.secondary_source(jax.lax.stop_gradient(x)) if w else x
                          for f, x, w in zip(fs, xs, want)])
    return [checkpoint_name(f.to_secondary(v), SECONDARY_NAME) if w else v
            for f, v, w in zip(fs, sources, want)]


def fetch_tree(fetches, stored, slots=None):
    """The full working weights of one fetch unit (a layer, the embedding, the head): one
    collective per bucket; with gradient slots, the gradients land (reduced over the grads
    axes) in the slots' cotangents (see the module docstring). slots None: forward only."""
    fs, tree = jax.tree.flatten(fetches, is_leaf=lambda v: isinstance(v, LeafFetch))
    srcs = secondaries(fs, tree.flatten_up_to(stored))
    if slots is None:
        return tree.unflatten(expand_all(fs, srcs))
    return tree.unflatten(_fetch(tuple(fs), tuple(srcs), tuple(tree.flatten_up_to(slots))))


def fetch_leaf(f: LeafFetch, x, slot=None):
    """fetch_tree of one weight."""
    return fetch_tree(f, x, slot)


def slot_like(f: LeafFetch, local_shape, tp_axes: tuple[str, ...], typed: bool = True):
    """Zeros shaped like this device's grads shard, typed (under check_vma) as the backward's
    result."""
    z = jnp.zeros(local_shape, jnp.dtype(f.grad_dtype))
    return to_varying(z, f.slot_axes() + tp_axes) if typed else z


__all__ = ["LeafFetch", "fetch_leaf", "fetch_tree", "slot_like", "to_varying", "varying_axes",
           "expand_all", "reduce_all", "SECONDARY_NAME"]
