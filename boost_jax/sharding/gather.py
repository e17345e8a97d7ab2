"""Per-layer weight fetch inside the manual step: ZeRO-3 gather, hpZ secondary, int8 (qwZ), and
the gradient's reduce-scatter into the grads sharding.

Runs inside the step's shard_map, manual over every mesh axis: x is this device's stored shard
(padded, TP-local, split over the params axes P on `layout.dim`). Which gathers run, over which
axes, int8 or not, is one method's answer (`gathers`: a Gather record each, which the engine
issues and step_collectives lists); S the secondary axes, forward | backward:

    no secondary          gather AG_P(x)                           | regather AG_P(x)
    S ⊇ P (P-major)       sec = to_S(x) saved; gather(S) AG_S(sec) | regather(S) AG_S(sec)
    S ⊂ P or ∅, not hpZ   gather AG_P(x), sec cut from it; gather(S) | regather(S) AG_S(sec)
    hpZ (S ⊂ P, prefix)   gather AG_P(x) once, sec its S-block     | regather(S) AG_S(sec)
    int8                  each shard quantized over src_axes, q and scales in one buffer; qwZ's
                          kept gather (S = ∅) and hpZ's packed sec: P's shards as they arrived

Each is a bucket.Send that bucket.run issues for the whole fetch unit (fetch_tree); the backward
re-gathers by remat, which saves SECONDARY_NAME, never the weight (layers/forward, hpz.py).

Gradient: the fetch is a custom_vjp whose primal ignores the slots (zeros shaped like this
device's accumulator shard) and whose backward reduce-scatters each full weight's cotangent
(grad_accum_dtype, zero-padded) over the grads axes G into its slot. The full weight is typed
varying over the batch axes so JAX does not reduce it over them: the deferred axes R stay
unreduced until the step's end, or are reduced here after G (Placement.in_backward).
Derivation (to_S, hpZ and int8 in full, the fetch units): benchmarks/README.md §3.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.layers.forward import SECONDARY_NAME, is_stacked
from boost_jax.mesh import axis_size
from boost_jax.names import STAGE_AXIS
from boost_jax.sharding import bucket, quant
from boost_jax.sharding.bucket import FLAT, Policy, Send, merge_stacked
from boost_jax.sharding.layout import LeafLayout, unpad



def varying_axes(x) -> frozenset:
    """Manual axes along which x may differ between devices (its vma type)."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def to_varying(x, axes):
    """Type x as varying over `axes` (identity forward; JAX transposes it to a psum)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Gather:
    """One gather of a weight's fetch in one pass: the entry step_collectives lists (moving
    over `axes`) and the description the engine issues it from (secondary_source, flat_send,
    expand). `what` is the list's name; a record over no axes moves nothing and only stands for
    a use of a copy kept whole (dequantized there when `decoded`)."""

    what: str  # gather | gather(S) | regather | regather(S)
    axes: tuple[str, ...]  # what it gathers over
    src_axes: tuple[str, ...]  # each shard it moves is one device's block over these (int8:
    # quantized over them; ≠ axes: the int8 shards over src_axes as they arrived, stacked)
    int8: bool  # q and scales of each shard, packed, instead of the working dtype
    when: str  # FORWARD or BACKWARD
    decoded: bool  # dequantized where it lands (Int8Copies.int8_decodes)
    source: bool = False  # its arrival is what the secondary is cut from (or kept as)

    def again(self) -> "Gather":
        """The same gather re-run in the backward (remat replays the forward's)."""
        return dataclasses.replace(self, what="re" + self.what, when=BACKWARD)


class Int8Copies:
    """Which gathers a weight's fetch runs, and which saved copies are int8, asked the same way
    by the engine (a leaf's fetch), the byte formulas and the cost model (a placement): both
    carry params_axes, secondary_axes, quantize_gather (qwZ), int8_secondary and replay."""

    @property
    def is_gathered(self) -> bool:
        """Stored sharded over the params axes (a leaf's fetch adds: on a dim)."""
        return bool(self.params_axes)

    @property
    def hpz(self) -> bool:
        """ZeRO++'s hpZ (S a non-empty proper prefix of the params axes P): the forward gathers
        over P once and keeps this device's S-block of what arrived as the secondary — no
        second gather, never quantized again (sharding/hpz.py runs the layer). Only where
        each layer's backward replays its forward anyway (train.remat=full, `replay`): other
        remat modes keep activations that a custom_vjp could not, and cut the secondary from
        the flat gather but gather it again in the forward."""
        P, S = tuple(self.params_axes), self.secondary_axes
        return self.replay and bool(S) and len(S) < len(P) and tuple(S) == P[:len(S)]

    @property
    def packed_secondary(self) -> bool:
        """An hpZ secondary under qwZ: the int8 shards over P as they arrived (q and scales
        packed, stacked [|P|/|S|, ...]), gathered over S in backward as they are."""
        return self.hpz and self.quantize_gather

    @property
    def keeps_int8_gather(self) -> bool:
        """An int8 gather kept whole (qwZ, S = ∅): the packed shards as they arrived are the
        secondary, dequantized at each use — never dequantized and quantized again."""
        return self.secondary_axes == () and self.quantize_gather

    @property
    def secondary_from_flat(self) -> bool:
        """The secondary is sliced from a flat gather over the params axes (ZeRO++'s hpZ,
        S ⊂ P), not locally from the stored shard (S ⊇ P, P-major)."""
        P, S = self.params_axes, self.secondary_axes
        return S is not None and S[:len(P)] != P

    @property
    def cuts_int8_secondary(self) -> bool:
        """An int8 secondary cut from the working-dtype weights (neither qwZ's gather kept nor
        hpZ's): to_secondary quantizes its S-block once per pass (the whole gathered weight
        when S = ∅) and both uses, forward and backward, dequantize it."""
        return (bool(self.params_axes) and self.int8_secondary and self.secondary_axes is not None
                and not self.hpz and not self.keeps_int8_gather)

    def gathers(self) -> tuple[Gather, ...]:
        """The gathers of a gathered weight's fetch in one forward and its backward, in order
        (the module docstring's table, case by case): the last is the backward's, which
        `expand` issues — in the forward too, as the record before it (the same gather under
        its forward name), unless hpZ's flat gather delivered the weight. The one the secondary
        is cut from is `source` (secondary_source, or hpZ's flat_send)."""
        if not self.is_gathered:
            return ()
        P, S, q, i8 = tuple(self.params_axes), self.secondary_axes, self.quantize_gather, \
            self.int8_secondary
        if S is None:
            g = Gather("gather", P, P, q, FORWARD, q)
            return g, g.again()
        S = tuple(S)
        if self.keeps_int8_gather:  # each use dequantizes the copy the gather delivered
            use = Gather("gather", (), P, True, FORWARD, True)
            return (Gather("gather", P, P, True, FORWARD, False, source=True), use,
                    dataclasses.replace(use, when=BACKWARD))
        flat = (Gather("gather", P, P, q, FORWARD, q, source=True),) \
            if self.secondary_from_flat else ()
        if self.hpz:  # the backward's gather of the S-block; packed: P's int8 shards
            packed = self.packed_secondary
            return flat + (Gather("regather(S)", S, P if packed else S, packed or i8,
                                  BACKWARD, packed or i8),)
        sec = Gather("gather(S)", S, S, i8, FORWARD, i8)
        return flat + (sec, sec.again())

    @property
    def int8_decodes(self) -> tuple[str, ...]:
        """The int8 copies a gathered weight's fetch dequantizes per pass, each named by the
        gather record that lands it (`gathers`: decoded): what expand, flat_full and
        secondary_source run (the cost model's kernels)."""
        return tuple(g.what for g in self.gathers() if g.decoded)


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
    int8_secondary: bool  # Placement.int8_secondary
    block: int
    dtype: str  # working-weight dtype: what the gathers move (before int8)
    grad_dtype: str  # what the gradient is reduced and accumulated in
    quantize_grads: bool = False  # qgZ: int4 all-to-all reduce-scatter of the gradient
    backward_reduction: tuple = ((), ())  # (AR, RS) axes of R reduced in the backward
    update: tuple = ()  # deferred update: the gathers stored → params shard (update_stages)
    replay: bool = False  # train.remat=full: each layer's backward replays its forward
    xq_weights: bool = False  # the deferred update's cross-node gather in int8
    xq_grads: str = "none"  # the gradient's cross-node reduce-scatter: none | int8 | int4
    collectives: Policy = FLAT  # the once-per-step legs' (deferred update, reduction over R)
    per_pass: Policy = FLAT  # every pass's gathers and gradient reductions (sharding/bucket.py)

    @classmethod
    def of(cls, pl, lay: LeafLayout) -> "LeafFetch":
        """The fetch of one leaf of a placement (per-layer layout of a stacked leaf)."""
        in_bwd = pl.deferred_reduction(lay) if pl.in_backward(lay) else ((), ())
        update = pl.update_stages() if pl.defer_update and lay.dim is not None else ()
        sizes = tuple((a, int(n)) for a, n in pl.mesh.shape.items())
        # log_step's exchanges run where one chain is in flight at a time (Policy.rings): in
        # the scanned layer stack without pipeline ticks, and, where the last micro-batch
        # runs apart from the others (reduce_in_backward), in the legs of its own passes only
        looped = lay.layer_axis and dict(sizes).get(STAGE_AXIS, 1) == 1
        legs = pl.collectives if looped else pl.collectives.rings()
        apart = pl.reduce_in_backward and pl.micro_batches > 1
        return cls(lay.sliced(), sizes,
                   pl.batch_axes, pl.params_axes, pl.grads_axes, pl.secondary_axes,
                   pl.quantize_gather, pl.int8_secondary, pl.quant_block, pl.param_dtype,
                   pl.grad_accum_dtype, pl.quantize_grads, in_bwd, update, pl.replay,
                   pl.xq_weights, pl.xq_grads, legs, legs.rings() if apart else legs)

    @functools.cached_property
    def _size(self) -> dict:  # (not a field: equality and hashing ignore it)
        return dict(self.sizes)

    def n(self, axes) -> int:
        return axis_size(self._size, axes)

    @property
    def dim(self):
        return self.layout.dim

    @property
    def is_gathered(self) -> bool:
        """Stored sharded over the params axes, so gathered before each use."""
        return self.dim is not None and bool(self.params_axes)

    def local_shape(self, axes) -> tuple[int, ...]:
        """This device's block of the (per-layer, padded) leaf when dim is split over `axes`."""
        return self.layout.local_shape(self._size, axes)

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

    def source_gather(self) -> Optional[Gather]:
        """The forward's gather the secondary is cut from (or kept as), if any."""
        return next((g for g in self.gathers() if g.source), None)

    def kept_as_arrived(self) -> bool:
        """The saved secondary is the int8 shards over another partition as they arrived
        (its gather's src_axes differ from its axes: qwZ's gather kept, hpZ's packed block)."""
        g = self.gathers()[-1]
        return g.src_axes != g.axes

    def secondary_source(self, x):
        """What the secondary is cut from: the stored shard (S ⊇ P, P-major), or (ZeRO++'s
        hpZ, S ⊂ P) the forward's flat gather over P, as DeepSpeed takes it."""
        g = self.source_gather()
        if g is None:
            return x
        send = self.gather(self.maybe_quantize(x, g.int8, g.src_axes), g.axes, g.src_axes)
        if g.int8 and not g.decoded:  # qwZ's gather kept: the secondary is what arrived
            return dataclasses.replace(send, finish=lambda a: a)
        return send

    def to_secondary(self, source):
        """secondary_source's result → this device's block of the secondary (int8: (q, s),
        or the stacked packed shards of a kept int8 gather)."""
        if self.kept_as_arrived():
            return source
        g, P = self.gathers()[-1], self.params_axes
        extra = g.axes if self.source_gather() else g.axes[len(P):]
        x = source
        if extra:
            k = x.shape[self.dim] // self.n(extra)
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(extra) * k, k, self.dim)
        return self.maybe_quantize(x.astype(self.dtype), g.int8, g.src_axes)

    def update_source(self, r: int) -> tuple[str, ...]:
        """Axes the input of the deferred update's r-th gather is sharded over."""
        return tuple(self.params_axes) + tuple(a for st in self.update[r:] for a in st)

    def update_gather(self, x, r: int):
        """The deferred update's r-th gather (step/engine.deferred_layers): int8 blocks across nodes
        with parallel.quantize_cross_node_weights=int8, else the working dtype."""
        axes, src = self.update[r], self.update_source(r)
        if self.xq_weights and "global" in axes:
            return self.gather(self.quantize(x, src), axes, src)
        return self.gather(x, axes, ())

    # ---------------------------------------------------------------- hpZ (sharding/hpz.py)
    def flat_send(self, x):
        """The forward's one gather of an hpZ weight over P (int8 under qwZ), as a bucket.Send
        delivering the stacked shards as they arrive."""
        g = self.source_gather()
        send = self.gather(self.maybe_quantize(x, g.int8, g.src_axes), g.axes, g.src_axes)
        return dataclasses.replace(send, finish=lambda a: a)

    def flat_full(self, arrived):
        """flat_send's stacked shards → the full (padded) weight."""
        g = self.source_gather()
        if g.decoded:
            return self.int8_finish(g.src_axes)(arrived)
        return merge_stacked(arrived, self.dim)

    def flat_secondary(self, arrived):
        """flat_send's stacked shards → this device's S-block of them: |P|/|S| consecutive
        shards (S is a prefix of P), kept packed as they arrived under qwZ; else merged (and
        quantized once for an int8 secondary of a working-dtype gather)."""
        g = self.gathers()[-1]  # the backward's gather of the block, over S
        m = self.n(self.source_gather().axes) // self.n(g.axes)
        x = jax.lax.dynamic_slice_in_dim(arrived, jax.lax.axis_index(g.axes) * m, m, 0)
        if self.kept_as_arrived():
            return x
        x = merge_stacked(x, self.dim).astype(self.dtype)
        return self.maybe_quantize(x, g.int8, g.src_axes)

    def expand(self, src):
        """The saved source (stored shard or secondary) → the gather of the full weight (a
        bucket.Send, or the value when nothing moves) as the backward's record (`gathers`)
        says; `working_weight` completes it."""
        if not self.is_gathered:
            return src
        g = self.gathers()[-1]
        if self.kept_as_arrived():  # [|axes|, |src|/|axes|, ...] arrive: src's shards in order
            finish = self.int8_finish(g.src_axes)
            if not g.axes:
                return finish(src)
            return Send("all-gather", g.axes, src, lambda a: finish(a.reshape(-1, *a.shape[2:])),
                        self.group)
        if self.secondary_axes is None:  # the stored shard, quantized here for an int8 gather
            src = self.maybe_quantize(src, g.int8, g.src_axes)
        return self.gather(src, g.axes, g.src_axes)

    def working_weight(self, full):
        """The gathered weight → the full, unpadded working weight, typed as the batch's."""
        full = unpad(self.layout, full.astype(self.dtype))
        return to_varying(full, self.batch_axes)

    # ---------------------------------------------------------------- backward
    def slot_axes(self) -> tuple[str, ...]:
        """Batch axes the gradient slot varies over (what is all-reduced is invariant)."""
        summed = set(self.backward_reduction[0])
        if self.dim is None:
            summed |= set(self.grads_axes)
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

    def reduce_step(self, ct, kind: str, axes, bits: int = 4) -> Send:
        """One step of `steps()` as a bucket.Send."""
        axes = tuple(axes)
        if kind == "all-to-all":
            return self.int4_reduce_scatter(ct, axes, bits)
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
        return self.grad_steps() + self.backward_reduction_steps()

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

    def backward_reduction_steps(self) -> list[tuple[str, tuple[str, ...]]]:
        """(kind, axes) of the reduction over R that runs in the backward (Placement.in_backward):
        AR over R − O, then RS over R ∩ O, as the once-per-step reduction would."""
        ar, rs = self.backward_reduction
        last = [self.cross_node_step(rs)] if rs else []
        return ([("all-reduce", ar)] if ar else []) + last

    def cross_node_step(self, rs) -> tuple:
        """The reduce-scatter over R ∩ O: quantized (an all-to-all of int8 or int4 blocks, with
        the bits) when it crosses nodes and parallel.quantize_cross_node_grads asks."""
        if self.xq_grads != "none" and "global" in rs:
            return ("all-to-all", tuple(rs), 8 if self.xq_grads == "int8" else 4)
        return ("reduce-scatter", tuple(rs))

    def int4_reduce_scatter(self, ct, axes, bits: int = 4, dim=None) -> Send:
        """ZeRO++'s qgZ step over `axes`: split the sharded dim into one chunk per device,
        quantize each chunk to int4 (or int8) blocks, all-to-all, dequantize and sum what
        arrives (fp32): the reduce-scatter of psum_scatter(tiled) at a quarter (a half) of
        fp32's bytes. `dim`: the sharded dim of `ct` (a whole stacked leaf: layout.dim + 1)."""
        n, d = self.n(axes), self.dim if dim is None else dim
        x = jnp.moveaxis(ct, d, 0)
        shard = (x.shape[0] // n,) + x.shape[1:]  # chunk i: rows i·L/n … (i+1)·L/n of dim
        x = x.reshape(n, -1)
        m = x.shape[1]
        block = self.qblock(m) + self.qblock(m) % 2  # int4 packs two values a byte

        def finish(arrived):
            if bits == 8:
                q, s = quant.unpack(arrived)
                y = jnp.sum(quant.dequantize(q, s, (n, m)), axis=0)
            else:
                q, s = quant.unpack(arrived, jnp.uint8)
                y = jnp.sum(quant.dequantize_int4(q, s, m), axis=0)
            return jnp.moveaxis(y.reshape(shard), 0, d).astype(ct.dtype)

        # packed int4/int8 and scales: one buffer
        q = quant.quantize(x, self.qblock(m)) if bits == 8 else quant.quantize_int4(x, block)
        return Send("all-to-all", axes, quant.pack(*q), finish, self.group)


def qgz_stages(G: tuple[str, ...]) -> list[tuple[str, ...]]:
    """qgZ reduces inside the node first, then across nodes: the grads axes split into the
    intra-node prefix and the rest (one stage if the canonical order does not allow it)."""
    inner = tuple(a for a in G if a != "global")
    if inner and len(inner) < len(G) and G[:len(inner)] == inner:
        return [inner, G[len(inner):]]
    return [G]


def _run(fs, requests, legs=None) -> list:
    """bucket.run under the fetch unit's policy: its passes' (`per_pass`), or its once-per-step
    legs' (`collectives`) for the requests whose flag in `legs` is set."""
    if not fs:
        return bucket.run(requests)
    flags = legs or [False] * len(requests)
    out = list(requests)
    for flag in set(flags):
        idx = [i for i, f in enumerate(flags) if f == flag]
        done = bucket.run([requests[i] for i in idx],
                          fs[0].collectives if flag else fs[0].per_pass)
        for i, v in zip(idx, done):
            out[i] = v
    return out


def expand_all(fs, srcs, ready=None) -> list:
    """Each weight's saved source → its full working weight (bucket.run issues the gathers);
    `ready[i]`: srcs[i] is already the full (padded) weight (hpZ's forward gather)."""
    ready = ready or (False,) * len(fs)
    return [f.working_weight(v) for f, v in zip(fs, _run(
        fs, [src if r else f.expand(src) for f, src, r in zip(fs, srcs, ready)]))]


def to_params_all(fs, xs) -> list:
    """Deferred update: each weight's stored shard (opt_state sharding, working dtype) → its
    params shard, the weights' r-th gathers (cross-node first) issued together."""
    xs = [jax.lax.stop_gradient(x) for x in xs]
    for r in range(max((len(f.update) for f in fs), default=0)):
        xs = _run(fs, [f.update_gather(x, r) if r < len(f.update) else x
                       for f, x in zip(fs, xs)], [True] * len(fs))
    return xs


def _plus(ct, prior):
    axes = varying_axes(ct) | varying_axes(prior)
    return to_varying(ct, axes) + to_varying(prior.astype(ct.dtype), axes)


def reduce_all(fs, cts, prior=None) -> list:
    """Each weight's cotangent → its slot's: the weights' r-th reduction steps run together
    (bucket.run: one int4 all-to-all per bucket). `prior`: the earlier micro-batches'
    accumulated gradient (grads shards), added once the grads reduction is done, before the
    reduction over R (the last micro-batch's backward)."""
    cts = [f.reduce_start(ct) for f, ct in zip(fs, cts)]
    steps = [f.steps() for f in fs]
    at = [len(f.grad_steps()) for f in fs]
    for r in range(max(map(len, steps), default=0) + 1):
        if prior is not None:
            cts = [_plus(ct, p) if r == a else ct for ct, p, a in zip(cts, prior, at)]
        if r < max(map(len, steps), default=0):
            cts = _run(fs, [f.reduce_step(ct, *st[r]) if r < len(st) else ct
                            for f, ct, st in zip(fs, cts, steps)], [r >= a for a in at])
    return [f.reduce_end(ct) for f, ct in zip(fs, cts)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fetch(fs: tuple, ready: tuple, srcs: tuple, slots: tuple, caps=None, kept=None,
           prior=None):
    """The unit's full weights; the cotangents: each slot's its weight's reduced gradient
    (`prior` added before the reduction over R), each of `caps` (a deferred update's
    capture) the params shard in `kept`."""
    del slots, caps, kept, prior
    return tuple(expand_all(fs, srcs, ready))


def _fetch_fwd(fs, ready, srcs, slots, caps=None, kept=None, prior=None):
    return _fetch(fs, ready, srcs, slots, caps, kept, prior), (caps, kept, prior)


def _fetch_bwd(fs, ready, res, cts):
    caps, kept, prior = res
    out = None if caps is None else tuple(
        to_varying(k, varying_axes(c)).astype(c.dtype) for k, c in zip(kept, caps))
    nones = lambda t: None if t is None else tuple(None for _ in t)  # noqa: E731
    return (nones(fs), tuple(reduce_all(fs, cts, prior)), out, nones(kept), nones(prior))


_fetch.defvjp(_fetch_fwd, _fetch_bwd)


def secondaries(fs, xs) -> list:
    """The saved source of each weight: its stored shard, or its secondary block, named for
    remat to keep (hpZ's weights are sharding/hpz.py's: left as they are here)."""
    want = [f.is_gathered and f.secondary_axes is not None and not f.hpz for f in fs]
    sources = _run(fs, [f.secondary_source(jax.lax.stop_gradient(x)) if w else x
                          for f, x, w in zip(fs, xs, want)])
    return [checkpoint_name(f.to_secondary(v), SECONDARY_NAME) if w else v
            for f, v, w in zip(fs, sources, want)]


@dataclass
class HpzForward:
    """A layer's stored shards fetched for the forward under hpZ (sharding/hpz.py): fetch_tree
    leaves each hpZ weight's secondary in `secs` (None for the others)."""

    stored: Any
    secs: Optional[list] = None


@dataclass(frozen=True)
class Deferred:
    """A fetch unit's weights as stored under a deferred update (opt_state sharding):
    fetch_tree gathers them to the params shard first (saved for remat, never gathered
    again), and hands those back as the cotangent of `capture` (zeros shaped like them) when
    given (step/engine.deferred_layers)."""

    stored: Any
    capture: Any = None


@dataclass(frozen=True)
class WithPrior:
    """A fetch unit's stored shards in the last of several micro-batches that reduce over R
    in the backward: `prior` (the earlier micro-batches' gradient, grads shards) joins each
    weight's gradient before that reduction (step/engine.py)."""

    stored: Any
    prior: Any


@dataclass(frozen=True)
class HpzBackward:
    """A layer's stored shards and the secondaries its forward kept: fetch_tree re-gathers the
    hpZ weights from these (AG over S) for the backward."""

    stored: Any
    secs: list


def _sources(fs, xs, stored):
    """(sources, ready flags) of a fetch unit's stored shards `xs`: hpZ weights by their one
    flat gather (the full weight, ready; an HpzForward `stored` keeps their secondaries) or,
    from an HpzBackward, their saved secondary; the rest by `secondaries`."""
    hpz = [f.is_gathered and f.hpz for f in fs]
    srcs = secondaries(fs, xs)
    if not any(hpz):
        return srcs, None
    if isinstance(stored, HpzBackward):
        return [s if h else v for h, s, v in zip(hpz, stored.secs, srcs)], None
    arrived = _run(fs, [f.flat_send(jax.lax.stop_gradient(x)) if h else None
                        for f, x, h in zip(fs, xs, hpz)])
    if isinstance(stored, HpzForward):
        stored.secs = [f.flat_secondary(a) if h else None for f, a, h in zip(fs, arrived, hpz)]
    return [f.flat_full(a) if h else v for f, a, v, h in zip(fs, arrived, srcs, hpz)], \
        tuple(hpz)


def fetch_tree(fetches, stored, slots=None):
    """The full working weights of one fetch unit (a layer, the embedding, the head): one
    collective per bucket; with gradient slots, the gradients land (reduced over the grads
    axes) in the slots' cotangents (see the module docstring). slots None: forward only.
    `stored`: the stored shards, or hpZ's HpzForward / HpzBackward wrapping them."""
    fs, tree = jax.tree.flatten(fetches, is_leaf=lambda v: isinstance(v, LeafFetch))
    prior = None
    if isinstance(stored, WithPrior):
        stored, prior = stored.stored, tuple(tree.flatten_up_to(stored.prior))
    wrapped = isinstance(stored, (HpzForward, HpzBackward, Deferred))
    xs = tree.flatten_up_to(stored.stored if wrapped else stored)
    caps = kept = None
    if isinstance(stored, Deferred):
        xs = [checkpoint_name(x, SECONDARY_NAME) for x in to_params_all(fs, xs)]
        if stored.capture is not None:
            caps, kept = tuple(tree.flatten_up_to(stored.capture)), tuple(xs)
    srcs, ready = _sources(fs, xs, stored)
    if slots is None:
        return tree.unflatten(expand_all(fs, srcs, ready))
    return tree.unflatten(_fetch(tuple(fs), ready or (False,) * len(fs), tuple(srcs),
                                 tuple(tree.flatten_up_to(slots)), caps, kept, prior))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stored", "slot"],
                   meta_fields=[])
@dataclass(frozen=True)
class WithSlot:
    """A fetch unit's stored shards (or a wrapper of them: Deferred, WithPrior, HpzForward,
    HpzBackward) and its gradient slots, one pytree node: lax.scan over the layer stack slices
    both, the forward hands it to ops.fetch as the weights, and Engine.fetch unpacks it."""

    stored: Any
    slot: Any


def paired(stored, slot):
    """WithSlot(stored, slot), or `stored` itself when there is no slot (forward only)."""
    return stored if slot is None else WithSlot(stored, slot)


def unpaired(weights) -> tuple:
    """What the forward fetches → (stored, gradient slots or None)."""
    return (weights.stored, weights.slot) if isinstance(weights, WithSlot) else (weights, None)


def with_slots(params, slots):
    """The params tree the forward reads in a training step: each fetch unit (the embedding,
    the layer stack or, unstacked, each layer, the final norm, the head) paired with its
    gradient slots; `slots` None: `params` as they are."""
    if slots is None:
        return params
    out = {k: WithSlot(v, slots[k]) for k, v in params.items()}
    if not is_stacked(params["blocks"]):
        out["blocks"] = {k: WithSlot(v, slots["blocks"][k]) for k, v in params["blocks"].items()}
    return out


def fetch_leaf(f: LeafFetch, x, slot=None):
    """fetch_tree of one weight."""
    return fetch_tree(f, x, slot)


def slot_like(f: LeafFetch, local_shape, tp_axes: tuple[str, ...],
              check_vma: bool = True):
    """Zeros shaped like this device's grads shard, typed (under check_vma) as the backward's
    result."""
    z = jnp.zeros(local_shape, jnp.dtype(f.grad_dtype))
    return to_varying(z, f.slot_axes() + tp_axes) if check_vma else z


__all__ = ["Gather", "LeafFetch", "fetch_leaf", "fetch_tree", "slot_like", "to_varying",
           "varying_axes", "expand_all", "reduce_all", "to_params_all", "Deferred", "HpzForward",
           "HpzBackward", "WithPrior", "WithSlot", "paired", "unpaired", "with_slots",
           "SECONDARY_NAME"]
