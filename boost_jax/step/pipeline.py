"""Pipeline parallelism inside the engine's shard_map: stages pass activations by collective-permute.

P stages (the mesh's `stage` axis) run m micro-batches in lock-step ticks; sharding/stages.py
says which layers each stage holds and, in its Schedule (1f1b or gpipe, interleaved virtual
stages), which micro-batch and chunk each stage runs at each tick.

F runs the stage forward on the activation received from s−1, sends its output to s+1 and
saves its input. B is `jax.vjp` of the same stage forward, re-run from the saved input, with
the gradient received from s+1; the input's gradient goes to s−1, the weights' gradients
(reduce-scattered by sharding/gather.py as without stages) to the accumulator. In training F
leaves out the head (final norm, LM head, loss): B's re-run computes it and the loss comes
from there, so every device runs the head forward once per B tick, not also per F tick. A
tick outside a stage's range of micro-batches is masked: the only collectives that cross
stages are these sends (and the step's scalar loss).
Derivation (what F and B run): benchmarks/README.md §9.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from boost_jax.layers import forward
from boost_jax.mesh import STAGE
from boost_jax.sharding.gather import to_varying, with_slots
from boost_jax.sharding.stages import ENDS, Schedule, layers_per_stage


def _varying(sds) -> frozenset:
    mat = getattr(sds, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or getattr(sds, "vma", ()) or ())


def squeeze_ends(tree):
    """The stage-slot dim of the end weights off (a device holds one slot)."""
    if tree is None:
        return None
    return {k: (jax.tree.map(lambda x: x[0], v) if k in ENDS else v) for k, v in tree.items()}


def send(tree, stages: int, step: int, cyclic: bool = False):
    """Each stage's `tree` to stage s+step (step ±1); the stage with no sender gets zeros.
    Cyclic (virtual stages): the last stage's forward output goes on to stage 0's next chunk,
    and stage 0's input gradient back to the last stage."""
    perm = [(i, (i + step) % stages) for i in range(stages)
            if cyclic or 0 <= i + step < stages]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, STAGE, perm), tree)


class Pipeline:
    """The loss and gradient of one device's stage over a schedule (used by step/engine.py).

    `schedule` the layout's (a training step's: sharding/parallel.py); the stage forward's
    pieces: `model` the model config, `ops` the forward's ops (weights fetched), `checkpoint`
    the per-layer remat wrapper, `slots()` zero gradient slots, `check_vma` the step's
    shard_map's flag (whether JAX types values as varying or invariant)."""

    def __init__(self, schedule: Schedule, model, ops, checkpoint: Callable,
                 slots: Callable, check_vma: bool):
        self.model, self.ops, self.checkpoint = model, ops, checkpoint
        self.slots, self.check_vma = slots, check_vma
        self.schedule = schedule
        self.n_stages = schedule.stages
        self.n_layers = model.n_layers
        self.virtual = schedule.virtual
        self.chunk_layers = layers_per_stage(self.n_layers, self.n_stages, self.virtual)

    # ------------------------------------------------------------------ one stage
    def stage_fn(self, params, slots, x, tokens, targets, v=0, head=True):
        """x = (h, latents) from the previous stage (None: start from the embedding), v the
        chunk (virtual stage v·P + s) → ((h, latents) for the next stage, this stage's loss
        (meaningful on the last chunk of the last stage; None without the `head`)); the
        forward reads the params paired with `slots` (gather.with_slots; None: forward only)."""
        ops, model, k = self.ops, self.model, self.chunk_layers
        stage = jax.lax.axis_index(STAGE)
        p = with_slots(squeeze_ends(params), squeeze_ends(slots))
        if self.virtual > 1:  # this chunk's k layers of the stage's V·k (stored and slots)
            p = dict(p, blocks=jax.tree.map(
                lambda a: jax.lax.dynamic_slice_in_dim(a, v * k, k), p["blocks"]))
        emb = ops.fetch(p["embed"], ("embed",))
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        h, prev = forward.embed(ops, emb, tokens, positions), ops.init_prev(tokens)
        if x is not None:
            first = (stage == 0) & (v == 0)
            h = jnp.where(first, h, x[0])
            prev = jax.tree.map(lambda a, b: jnp.where(first, a, b), prev, x[1])
        elif self.check_vma:  # typing only (zeros_like_outputs): latents pass stage-varying weights
            prev = jax.tree.map(lambda a: to_varying(a, (STAGE,)), prev)
        active = (v * self.n_stages + stage) * k + jnp.arange(k) < self.n_layers
        h, prev = forward.run_blocks(ops, model, p["blocks"], h, positions, prev,
                                     self.checkpoint, active)
        if not head:
            return (h, prev), None
        norm, w = forward.head_weights(ops, model, p)
        return (h, prev), ops.head_loss(h, norm, w, targets)

    def zeros_like_outputs(self, params, slots, tokens, targets):
        """Zero (activation, latents) and loss typed as the stage forward's outputs."""
        def typed(sds):
            z = jnp.zeros(sds.shape, sds.dtype)
            return to_varying(z, tuple(_varying(sds))) if self.check_vma else z

        x = prev_out = None
        for _ in range(3):  # the carry's type: a fixed point of the stage forward
            out, loss = jax.eval_shape(lambda x: self.stage_fn(params, slots, x, tokens, targets),
                                       x)
            new = jax.tree.map(typed, out)
            if x is not None and jax.tree.map(_varying, out) == jax.tree.map(_varying, prev_out):
                break
            x, prev_out = new, out
        return x, typed(loss)

    # ------------------------------------------------------------------ the schedule
    def run(self, params, mb, barrier, scale: float, backward: bool, acc=None):
        """All ticks of the schedule over micro-batches `mb` ([m, rows, s] each).

        Returns (Σ over this device's valid last-stage forwards (in training, B's re-runs) of
        loss · scale, accumulated gradient slots or None)."""
        m = mb["inputs"].shape[0]
        # over this call's m micro-batches (the step's list counts the same: Passes.of)
        sch = dataclasses.replace(self.schedule, micro=m)
        if not backward:  # forward only: no B ticks to interleave
            sch = dataclasses.replace(sch, kind="gpipe")
        stage = jax.lax.axis_index(STAGE)
        last_stage = stage == self.n_stages - 1
        slots = self.slots() if backward else None
        x0, loss0 = self.zeros_like_outputs(params, slots, mb["inputs"][0], mb["targets"][0])
        ticks = _Ticks(self, sch, params, slots, mb, barrier, scale, stage, last_stage, loss0)
        carry = ticks.initial_carry(x0)
        if backward:
            carry["acc"] = acc
        t0 = 0
        for n, do_f, do_b, do_send in sch.phases:
            if do_b and not backward:
                continue
            carry, _ = jax.lax.scan(ticks.tick(do_f, do_b, do_send), carry,
                                    jnp.arange(t0, t0 + n, dtype=jnp.int32))
            t0 += n
        return carry["loss"], carry.get("acc")


@dataclass
class _Ticks:
    """One Pipeline.run: what its ticks read (traced values included) and the tick bodies.

    The scan carry: act_from_prev / grad_from_next the activation / gradient received from
    the previous / next stage, loss the scaled loss so far, buf the saved stage inputs
    (depth + 1 slots: the last takes masked writes), acc (backward only) the gradient
    accumulator."""

    pipe: Pipeline
    sch: Schedule
    params: Any
    slots: Any  # gradient slots (backward) or None
    mb: dict  # micro-batches: inputs, targets [m, rows, s]
    barrier: Callable
    scale: float
    stage: Any  # this device's stage (traced)
    last_stage: Any  # stage == n_stages − 1 (traced)
    loss0: Any  # a zero loss typed as the stage forward's

    def initial_carry(self, x0) -> dict:
        depth = self.sch.depth
        return {"act_from_prev": x0, "grad_from_next": x0, "loss": self.loss0,
                "buf": jax.tree.map(lambda z: jnp.zeros((depth + 1, *z.shape), z.dtype) + z,
                                    x0)}

    def _unit(self, k, backward: bool):
        """(micro-batch, chunk, valid?, last chunk of the last stage?, tokens, targets)."""
        sch, m = self.sch, self.sch.micro
        i, v = sch.unit(k, backward=backward)
        ok = (k >= 0) & (k < sch.units) & (i < m)
        last = self.last_stage & (v == sch.virtual - 1)
        j = jnp.clip(i, 0, m - 1)
        return i, v, ok, last, self.mb["inputs"][j], self.mb["targets"][j]

    def forward_tick(self, c, t):
        f = self.sch.forward_index(t, self.stage)
        i, v, ok, last, tok, tgt = self._unit(f, backward=False)
        p = self.barrier(self.params, tok)
        x_in = c["act_from_prev"]
        x_out, loss = self.pipe.stage_fn(p, self.slots, x_in, tok, tgt, v,
                                         head=self.slots is None)  # training: B's loss
        depth = self.sch.depth
        slot = jnp.where(ok, jnp.mod(f, depth), depth)  # masked writes land in the spare slot
        c = dict(c, buf=jax.tree.map(lambda b, x: b.at[slot].set(x), c["buf"], x_in))
        if loss is not None:
            c["loss"] = c["loss"] + jnp.where(ok & last, loss * self.scale, 0.0)
        return c, x_out

    def backward_tick(self, c, t):
        sch, loss0 = self.sch, self.loss0
        b = sch.backward_index(t, self.stage)
        i, v, ok, last, tok, tgt = self._unit(b, backward=True)
        p = self.barrier(self.params, tok)
        x_b = jax.tree.map(lambda buf: buf[jnp.mod(sch.forward_slot(i, v), sch.depth)], c["buf"])
        g_out = jax.tree.map(lambda g: jnp.where(ok & ~last, g, jnp.zeros_like(g)),
                             c["grad_from_next"])
        g_loss = jnp.where(ok & last, self.scale, 0.0).astype(loss0.dtype) + loss0
        (_, loss), vjp = jax.vjp(lambda sl, x: self.pipe.stage_fn(p, sl, x, tok, tgt, v),
                                 self.slots, x_b)
        g_slots, g_x = vjp((g_out, g_loss))
        acc = jax.tree.map(lambda a, g: a + jnp.where(ok, g.astype(a.dtype),
                                                      jnp.zeros_like(a)), c["acc"], g_slots)
        loss = c["loss"] + jnp.where(ok & last, loss * self.scale, 0.0)
        return dict(c, acc=acc, loss=loss), g_x

    def tick(self, do_f: bool, do_b: bool, do_send: bool):
        """The scan body of one schedule phase: F and/or B, then the sends."""
        n_stages, cyclic = self.pipe.n_stages, self.sch.virtual > 1

        def body(c, t):
            if do_f:
                c, out_f = self.forward_tick(c, t)
            if do_b:
                c, out_b = self.backward_tick(c, t)
            if do_f and do_send:
                c = dict(c, act_from_prev=send(out_f, n_stages, +1, cyclic))
            if do_b and do_send:
                c = dict(c, grad_from_next=send(out_b, n_stages, -1, cyclic))
            return c, None

        return body


__all__ = ["Pipeline", "squeeze_ends", "send"]

