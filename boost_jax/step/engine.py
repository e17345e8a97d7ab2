"""One engine for every plan × TP layout: the loss and its gradient, manual over every mesh axis.

`grads_fn(params, batch) -> (loss, grads)` runs as ONE jax.shard_map over all mesh axes (pair,
node, global). Each device holds its rows of the batch and its shards of the stored weights,
and every collective in it is written in one place:

    for each micro-batch m (lax.scan):
        each layer fetches its weights just before use          sharding/gather.py
            (AG over params axes, or over the secondary's, int8 or not; backward re-gathers;
            hpZ: one flat gather, the secondary cut from it; remat=full)  hpz.py
        the blocks run the forward written once (+ TP all-reduces) layers/forward.py, sharding/tp/
        the gradient of this device's rows lands in the grads
            sharding (reduce-scatter over grads axes, in
            grad_accum_dtype) and is added to the accumulator   gather.reduce_all
    once per step (reduce_deferred): the accumulator, unreduced over the batch axes R that
        grads do not cover, is reduced straight into the opt_state sharding (AR over R − opt,
        RS over R ∩ opt) — with one micro-batch and no pipeline each scanned layer's
        backward does it right after the reduction over grads      Placement.in_backward
Every data-parallel collective above is listed, with its bytes and calls, by
sharding/step_collectives.py (two_level / auto: as rank-aligned stages over `global` and inside
the node, sharding/bucket.py). Each device differentiates its rows' mean CE / (data-parallel
devices × micro-batches), so the reductions sum to the gradient of the global mean. GSPMD only
places the step's inputs and outputs; the optimizer (step/build.py) runs on the opt_state
shards. Engine(layout) takes the resolved ParallelLayout (sharding/parallel.py), never the Config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from boost_jax.backends import cpu as cpu_backend
from boost_jax.layers import forward
from boost_jax.mesh import STAGE, axis_size
from boost_jax.sharding.gather import (Deferred, LeafFetch, WithPrior, fetch_tree, paired,
                                      slot_like, to_params_all, to_varying, unpaired,
                                      varying_axes, with_slots)
from boost_jax.sharding import bucket
from boost_jax.sharding.hpz import hpz_layers
from boost_jax.sharding.layout import LeafLayout, is_layout, spec_entry
from boost_jax.sharding.parallel import ParallelLayout
from boost_jax.step.pipeline import Pipeline


def deferred_layers(checkpoint: Callable, capture: bool) -> Callable:
    """The per-layer wrapper of a deferred update's first micro-batch (the plan's remat
    `checkpoint` around it): layer(weights, h, prev) is called with the stored shards in
    `weights` wrapped in Deferred; with `capture` their slots are {"grads", "params"} and the
    cotangent of "params" is the layer's params shards.

    A deferred update (parallel.defer_update) moves the new weights' gather to the params
    sharding from after the optimizer into the next step's first forward, layer by layer: the
    step stores the updated working weights cast on their opt_state shard (step/build.py), and
    the first micro-batch fetches each layer from there, gathering over opt_state − grads axes
    (across nodes: the node's shard only), then grads − params axes (inside the node), to the
    params shard (Placement.update_stages), then as every micro-batch does. XLA pipelines these
    gathers behind the previous layer's compute, as it does a ZeRO-3 layer's. The params shards
    are named for remat to keep (the backward never gathers across nodes again) and leave the
    layer loop as the cotangent of the `capture` slot, so the step's other micro-batches start
    from them (Engine.first_micro_batch). The final norm and an untied head are fetched the same
    way where the forward uses them (Engine.deferred_ends); the embedding, needed first, is
    gathered once at the start of the step (Engine.ends_to_params)."""

    def wrap(layer):
        def first(weights, h, prev):
            lp, ls = unpaired(weights)
            if capture:
                return layer(paired(Deferred(lp, ls["params"]), ls["grads"]), h, prev)
            return layer(paired(Deferred(lp), ls), h, prev)

        return checkpoint(first)

    return wrap


def _tp_axes(lay: LeafLayout) -> tuple[str, ...]:
    return tuple(a for tp in lay.tp for a in tp)


@dataclass
class Engine:
    """The step's loss and gradient programs for one ParallelLayout (sharding/parallel.py)."""

    layout: ParallelLayout

    def __post_init__(self):
        layout, placement = self.layout, self.layout.placement
        self.mesh, self.placement = layout.mesh, placement
        self.n_batch = axis_size(self.mesh, placement.batch_axes)
        self.fetches = jax.tree.map(lambda lay: LeafFetch.of(placement, lay), placement.layouts,
                                    is_leaf=is_layout)
        gathers = any(f.is_gathered for f in jax.tree.leaves(
            self.fetches, is_leaf=lambda v: isinstance(v, LeafFetch)))
        # the micro-batches before the last accumulate over the grads axes only
        self.early = jax.tree.map(
            lambda f: dataclasses.replace(f, backward_reduction=((), ())), self.fetches,
            is_leaf=lambda v: isinstance(v, LeafFetch))
        self.active = self.fetches
        self.checkpoint = layout.checkpoint(gathers)
        if any(f.is_gathered and f.hpz for f in jax.tree.leaves(
                self.fetches, is_leaf=lambda v: isinstance(v, LeafFetch))):
            self.checkpoint = hpz_layers  # one forward gather per layer (sharding/hpz.py)
        # the units used once after the layer stack (final norm, untied head): fetched and
        # reduced like a layer where the placement says so (LeafLayout.after_stack)
        self.after_stack = tuple(
            k for k, lays in placement.layouts.items() if k != "blocks" and all(
                lay.after_stack for lay in jax.tree.leaves(lays, is_leaf=is_layout)))
        self.ops = layout.ops(self.fetch)
        self.check_vma = layout.check_vma
        self.tp_size = axis_size(self.mesh, placement.tp_axes)
        self.pipeline = None if layout.pipeline is None else Pipeline(
            layout.pipeline, layout.model, self.ops, self.checkpoint, self.slots, self.check_vma)

    # ------------------------------------------------------------------ per-device pieces
    def fetch(self, weights, path):
        """ops.fetch: what with_slots put at `path` (stored shards, and gradient slots in a
        training step) → the full working weights (sharding/gather.py: fetch_tree)."""
        fs = self.active  # the last (or only) micro-batch's, or the earlier ones'
        for k in path:
            fs = fs[k]
        return fetch_tree(fs, *unpaired(weights))

    def slots(self, last: bool = True):
        """Zero gradient slots: this device's shard of every leaf's gradient — the grads
        shard, or the opt_state shard when the backward reduces it over R (`last`: the
        last, or only, micro-batch) — typed as the gradient."""
        pl = self.placement

        def one(lay, f):
            rs = pl.deferred_reduction(lay)[1] if last and pl.in_backward(lay) else ()
            return slot_like(f, lay.local_shape(self.mesh, tuple(pl.grads_axes) + rs),
                             _tp_axes(lay), self.check_vma)

        fetches = self.fetches if last else self.early
        return jax.tree.map(one, pl.layouts, fetches, is_leaf=is_layout)

    def reduce_deferred(self, lay: LeafLayout, acc, f: LeafFetch):
        """Once per step: the accumulator, unreduced over the deferred axes → the opt_state
        shard (else the grads shard), as Placement.deferred_reduction lists it (the cross-node
        reduce-scatter quantized as LeafFetch.cross_node_step says); nothing left to do when
        the backward reduced it (Placement.in_backward)."""
        if self.placement.in_backward(lay):
            return acc
        ar, rs = self.placement.deferred_reduction(lay)
        policy = self.placement.step_policy
        if ar:
            acc = bucket.all_reduce(acc, ar, policy)
        if rs and f.cross_node_step(rs)[0] == "all-to-all":
            send = f.int4_reduce_scatter(acc, tuple(rs), f.cross_node_step(rs)[2], lay.dim)
            acc = bucket.run([send])[0]
        elif rs:
            acc = bucket.psum_scatter(acc, rs, lay.dim, policy)
        return acc

    def local_loss(self, params, batch, checkpoint=None):
        """This device's loss; `params` as the forward reads them (with_slots: paired with
        the gradient slots to differentiate with respect to)."""
        return forward.loss(self.ops, self.layout.model, params, batch,
                            checkpoint or self.checkpoint)

    # ------------------------------------------------------------------ deferred update
    def ends_to_params(self, params):
        """Deferred update: the weights outside the layer loop that the forward needs first
        (the embedding) gathered from their stored shards to the params sharding, once per
        step; the layer stack and the after-stack units stay stored (their forward fetch
        gathers them: deferred_layers, deferred_ends)."""
        out = dict(params)
        for k in params:
            if k != "blocks" and k not in self.after_stack:
                fs, tree = jax.tree.flatten(self.fetches[k],
                                            is_leaf=lambda v: isinstance(v, LeafFetch))
                out[k] = tree.unflatten(to_params_all(fs, tree.flatten_up_to(params[k])))
        return out

    def deferred_ends(self, params, slots=None, capture=False):
        """with_slots(params, slots) with the after-stack units' stored shards wrapped in
        Deferred, so their gather to the params shard runs where the forward fetches them,
        behind the layers' compute; with `capture` their slots are {"grads", "params"}
        (capture_slots)."""
        params, slots = dict(params), None if slots is None else dict(slots)
        for k in self.after_stack:
            cap = None
            if capture:
                cap, slots[k] = slots[k]["params"], slots[k]["grads"]
            params[k] = Deferred(params[k], cap)
        return with_slots(params, slots)

    def capture_zeros(self, lays, stored):
        """Zeros shaped and typed like the params shards of `stored` (a capture's slots)."""
        pdtype = jnp.dtype(self.placement.param_dtype)

        def zeros(lay, x):
            z = jnp.zeros(lay.local_shape(self.mesh, self.placement.params_axes), pdtype)
            return to_varying(z, varying_axes(x))

        return jax.tree.map(zeros, lays, stored, is_leaf=is_layout)

    def capture_slots(self, slots, stored):
        """The first micro-batch's slots: the layer stack's and each after-stack unit's as
        {"grads": the slots, "params": zeros shaped and typed like the params shards its
        backward hands back} (the stack's per layer when it is not scanned)."""
        lays = self.placement.layouts
        out = dict(slots, blocks=self.pair_blocks(slots["blocks"], self.capture_zeros(
            lays["blocks"], stored["blocks"]), "params"))
        for k in self.after_stack:
            out[k] = {"grads": slots[k], "params": self.capture_zeros(lays[k], stored[k])}
        return out

    def first_micro_batch(self, params, b, scale, micro):
        """Deferred update, micro-batch 0: (loss, gradient, params with the params shards its
        forward gathered, for the other micro-batches)."""
        params = self.ends_to_params(params)
        p = self.barrier(params, b["inputs"])
        capture = micro > 1
        slots = self.slots(not capture)
        if capture:
            slots = self.capture_slots(slots, p)

        def objective(s):
            q = self.deferred_ends(p, s, capture)
            return self.local_loss(q, b, deferred_layers(self.checkpoint, capture)) * scale

        loss, g = jax.value_and_grad(objective)(slots)
        if capture:
            gb = g["blocks"]
            params = dict(params, blocks=self.unpair_blocks(gb, "params"),
                          **{k: g[k]["params"] for k in self.after_stack})
            g = dict(g, blocks=self.unpair_blocks(gb, "grads"),
                     **{k: g[k]["grads"] for k in self.after_stack})
        return loss, g, params

    # ------------------------------------------------------------------ the two programs
    def specs(self):
        placement = self.placement
        params = jax.tree.map(lambda l: l.spec(placement.stored_axes), placement.layouts,
                              is_leaf=is_layout)
        grads = jax.tree.map(
            lambda l: l.spec(placement.opt_state_axes if placement.reduces_into_opt_state(l)
                             else placement.grads_axes),
            placement.layouts, is_leaf=is_layout)
        rows = P(spec_entry(placement.batch_axes))
        return params, {"inputs": rows, "targets": rows}, grads

    def smap(self, body, in_specs, out_specs):
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=self.check_vma)

    def grads_fn(self, micro: int) -> Callable:
        """(params, batch) -> (mean loss, gradient in the opt_state sharding, accum dtype)."""
        if micro != self.layout.micro_batches:  # the placement's gradient path depends on it
            raise ValueError(f"grads_fn({micro}) on a layout resolved for "
                             f"train.micro_batches={self.layout.micro_batches}")
        pspec, bspec, gspec = self.specs()
        scale = 1.0 / (self.n_batch * micro)
        acc_dtype = jnp.dtype(self.placement.grad_accum_dtype)

        def body(params, batch):
            mb = jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]),
                              batch)
            if self.pipeline is not None:  # zeros in grad_accum_dtype to accumulate into
                loss, acc = self.pipeline.run(params, mb, self.barrier, scale, True,
                                              self.slots())
            else:
                loss, acc = self.micro_loop(params, mb, scale, micro)
            grads = jax.tree.map(self.reduce_deferred, self.placement.layouts, acc,
                                 self.fetches, is_leaf=is_layout)
            if not self.check_vma:
                grads = cpu_backend.untyped_tp_grads(grads, self.placement.layouts,
                                                     self.placement.tp_axes, self.tp_size)
            return self.sum_over_devices(loss), grads

        return self.smap(body, (pspec, bspec), (P(), gspec))

    def micro_loop(self, params, mb, scale, micro):
        """(Σ loss, gradient) of the micro-batches without a pipeline: a deferred update's
        first (first_micro_batch), the middle ones (a scan), and, with several, the last,
        whose backward adds their gradient before reducing each layer's over R."""
        acc_dtype = jnp.dtype(self.placement.grad_accum_dtype)
        k = micro
        peel_last = k > 1 and self.placement.reduce_in_backward  # the last runs apart

        def add(acc, g):
            return jax.tree.map(lambda a, x: a + x.astype(acc_dtype), acc, g)

        def one(params, acc, b):
            p = self.barrier(params, b["inputs"])
            loss, g = jax.value_and_grad(
                lambda s: self.local_loss(with_slots(p, s), b) * scale)(self.slots(not peel_last))
            return add(acc, g), loss

        self.active = self.early if peel_last else self.fetches
        acc, loss, p, start = self.slots(not peel_last), 0.0, params, 0
        if self.placement.defer_update:  # micro-batch 0 gathers the stored weights
            loss, g, p = self.first_micro_batch(params, jax.tree.map(lambda x: x[0], mb),
                                                scale, micro)
            acc, start = add(acc, g), 1
        stop = k - 1 if peel_last else k
        if stop > start:
            acc, losses = jax.lax.scan(lambda a, b: one(p, a, b), acc,
                                       jax.tree.map(lambda x: x[start:stop], mb))
            loss = loss + jnp.sum(losses)
        self.active = self.fetches
        if peel_last:
            lloss, acc = self.last_micro_batch(p, jax.tree.map(lambda x: x[k - 1], mb), acc,
                                               scale)
            loss = loss + lloss
        return loss, acc

    def last_micro_batch(self, params, b, acc, scale):
        """The last of several micro-batches: the layer stack's slots carry the accumulated
        gradient as a `prior` its backward adds before each layer's reduction over R (the
        opt_state shards come out); the rest is accumulated as before."""
        slots = self.slots(True)
        blocks = self.pair_blocks(slots["blocks"], acc["blocks"], "prior")
        ck = self.checkpoint

        def wrap(layer):
            def last(weights, h, prev):
                stored, ls = unpaired(weights)
                return layer(paired(WithPrior(stored, ls["prior"]), ls["grads"]), h, prev)

            return ck(last)

        b = dict(b, inputs=self.after_loop(b["inputs"], acc))
        p = self.barrier(params, b["inputs"])
        if self.placement.defer_update:  # the ends as the first micro-batch fetched them:
            zero = (b["inputs"].reshape(-1)[0].astype(jnp.float32) * 0.0)  # not one CSE'd call
            p = {k: v if k == "blocks" else jax.tree.map(lambda x: x + zero.astype(x.dtype), v)
                 for k, v in p.items()}
        # the after-stack units reduce in the backward too (this runs only under
        # reduce_in_backward): they take their prior as the stack does
        late = self.after_stack
        q = dict(p, **{k: WithPrior(p[k], acc[k]) for k in late})
        loss, g = jax.value_and_grad(
            lambda s: self.local_loss(with_slots(q, s), b, wrap) * scale)(
            dict(slots, blocks=blocks))
        acc_dtype = jnp.dtype(self.placement.grad_accum_dtype)
        out = {k: (self.unpair_blocks(v, "grads") if k == "blocks" else v if k in late else
                   jax.tree.map(lambda a, x: a + x.astype(acc_dtype), acc[k], v))
               for k, v in g.items()}
        return loss, out

    @staticmethod
    def after_loop(inputs, acc):
        """The last micro-batch's inputs tied to the loop's accumulated gradient: its forward
        (the saved activations of a second micro-batch) cannot start beside the loop's."""
        same = [x for x in jax.tree.leaves(acc) if varying_axes(x) <= varying_axes(inputs)]
        return jax.lax.optimization_barrier((inputs, same[0]))[0] if same else inputs

    @staticmethod
    def pair_blocks(grads, other, name):
        """The layer stack's slots {"grads": …, name: …} (per layer when not scanned)."""
        if forward.is_stacked(grads):
            return {"grads": grads, name: other}
        return {k: {"grads": grads[k], name: other[k]} for k in grads}

    @staticmethod
    def unpair_blocks(tree, name):
        if "grads" in tree:
            return tree[name]
        return {k: v[name] for k, v in tree.items()}

    @staticmethod
    def barrier(params, anchor):
        """The weights tied to one micro-batch: XLA may not hoist their (loop-invariant)
        gathers out of the loop, so full weights never stay alive across micro-batches. One
        barrier per leaf: a barrier types its outputs with the union of its operands' varying
        axes, and a TP-replicated weight must stay invariant over TP."""
        return jax.tree.map(lambda x: jax.lax.optimization_barrier((x, anchor))[0], params)

    def sum_over_devices(self, loss):
        """Σ of per-device scaled losses over the data-parallel devices (identical over TP;
        with pipeline stages only the last stage's is not zero)."""
        axes = self.placement.batch_axes + ((STAGE,) if self.pipeline is not None else ())
        return bucket.all_reduce(loss, axes, self.placement.collectives) if axes else loss

    def loss_fn(self) -> Callable:
        """(params, batch) -> mean loss (evaluation: forward only, no slots)."""
        pspec, bspec, _ = self.specs()

        def body(params, batch):
            if self.pipeline is not None:
                mb = jax.tree.map(lambda x: x[None], batch)
                loss, _ = self.pipeline.run(params, mb, self.barrier, 1.0 / self.n_batch, False)
                return self.sum_over_devices(loss)
            if self.placement.defer_update:
                first = deferred_layers(self.checkpoint, False)
                q = self.deferred_ends(self.ends_to_params(params))
                loss = self.local_loss(q, batch, first)
                return self.sum_over_devices(loss / self.n_batch)
            return self.sum_over_devices(self.local_loss(params, batch) / self.n_batch)

        return self.smap(body, (pspec, bspec), P())
